"""Backends added and removed at run time through the admin API.

POST /admin/backends adds an engine (it takes requests once its health check passes);
DELETE /admin/backends/{name} drains it (the requests it serves finish) and forgets it once
idle. Only the operator (server.admin_api_key) names hosts, and the URL must be a plain
http(s) base URL.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from engine_launcher.sim import SimEngineConfig, start_sim_engine
from router.routing.planning import Plan, RouteQuery
from router.routing.snapshot import ClusterSnapshot
from support.cluster import MODEL, Cluster, MakeCluster, dispatcher_of, long_prompt, registry_of
from support.polling import eventually

ADMIN = {"Authorization": "Bearer sk-admin"}


async def call(
    c: Cluster, method: str, path: str, body: bytes | dict[str, Any] | None = None, headers: dict[str, str] = ADMIN
) -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else orjson.dumps(body))
    async with c.session.request(method, c.url + path, data=data, headers=headers) as r:
        return r.status, orjson.loads(await r.read())


async def served(url: str, session: aiohttp.ClientSession) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:request_success_total"))


async def test_added_backend_takes_requests_and_removal_lets_its_stream_finish(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1, server={"admin_api_key": "sk-admin"})
    extra = await start_sim_engine(SimEngineConfig(model=MODEL, speed=2.0, role="consumer"), port=0)
    try:
        status, view = await call(
            c, "POST", "/admin/backends", {"name": "late", "url": extra.url, "role": "decode", "models": [MODEL]}
        )
        assert status == 201, view
        assert view["name"] == "late"
        assert view["source"] == "admin"
        assert view["healthy"] is True
        assert c.router_metric("cachehit_router_backend_healthy", backend="late") == 1

        # The old engine is drained: every new request must go to the added one.
        assert (await call(c, "POST", "/admin/backends/d0/drain"))[0] == 200
        before = await served(extra.url, c.session)
        status, out = await c.complete({"model": MODEL, "prompt": "hello there", "max_tokens": 3})
        assert status == 200, out
        assert await served(extra.url, c.session) > before
        assert (await call(c, "POST", "/admin/backends/d0/enable"))[0] == 200

        # A long stream runs on "late" (d0 drained again so it must land there) when it is removed.
        assert (await call(c, "POST", "/admin/backends/d0/drain"))[0] == 200
        stream = asyncio.create_task(c.stream({"model": MODEL, "prompt": long_prompt("rm", 50), "max_tokens": 60}))
        await eventually(
            lambda: extra.engine.num_running > 0 or stream.done(), what="the stream to run on the added engine"
        )
        assert not stream.done(), stream.result()
        assert (await call(c, "POST", "/admin/backends/d0/enable"))[0] == 200
        status, view = await call(c, "DELETE", "/admin/backends/late")
        assert status == 202
        assert view["draining"] is True
        assert view["removing"] is True
        # Still listed (and refusing re-enabling) while its stream runs.
        status, listed = await call(c, "GET", "/admin/backends")
        assert {b["name"] for b in listed} == {"d0", "late"}
        assert (await call(c, "POST", "/admin/backends/late/enable"))[0] == 409

        status, events = await stream
        assert status == 200
        assert events[-1] == "[DONE]"
        assert not any("error" in e for e in events[:-1])
        assert sum(1 for e in events[:-1] if e.get("choices") and e["choices"][0].get("text")) == 60

        await eventually(lambda: "late" not in c.registry.states, what="the removal")
        status, listed = await call(c, "GET", "/admin/backends")
        assert [b["name"] for b in listed] == ["d0"]
        # Its gauges are gone with it.
        for gauge in (
            "cachehit_router_backend_healthy",
            "cachehit_router_backend_queued_prefill_tokens",
            "cachehit_router_backend_prefill_tokens_per_second",
            "cachehit_router_backend_threshold_capable",
        ):
            assert c.state.metrics.registry.get_sample_value(gauge, {"backend": "late"}) is None, gauge
        # No series at all labelled with it on /metrics (gauges, probe and error counters).
        async with c.session.get(c.url + "/metrics") as r:
            exposition = await r.text()
        assert [line for line in exposition.splitlines() if 'backend="late"' in line] == []
        # Its model entries no longer merge into the router's /v1/models.
        assert c.state.monitor is not None
        assert "late" not in c.state.monitor.model_cards
        before = await served(extra.url, c.session)
        for i in range(3):
            assert (await c.complete({"model": MODEL, "prompt": f"after {i}", "max_tokens": 2}))[0] == 200
        assert await served(extra.url, c.session) == before
    finally:
        await extra.close()


async def test_added_backend_that_does_not_answer_gets_no_requests(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1, server={"admin_api_key": "sk-admin"})
    # Nothing listens on port 9 of loopback (discard; closed here).
    status, view = await call(
        c, "POST", "/admin/backends", {"name": "dead", "url": "http://127.0.0.1:9", "role": "decode"}
    )
    assert status == 201, view
    assert view["healthy"] is False, view
    for i in range(4):
        status, out = await c.complete({"model": MODEL, "prompt": f"still fine {i}", "max_tokens": 2})
        assert status == 200, out
    assert c.router_metric_or_zero("cachehit_router_upstream_errors_total", backend="dead", kind="connect") == 0


async def test_admin_add_validates_the_operators_input(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1, server={"admin_api_key": "sk-admin"})
    d0 = c.engines["d0"].url
    bad: list[tuple[dict[str, Any], str]] = [
        ({"name": "x", "url": "ftp://10.0.0.1:21"}, "url"),
        ({"name": "x", "url": "http://"}, "url"),
        ({"name": "x", "url": "http://10.0.0.1:8000/?next=evil"}, "url"),
        ({"name": "x", "url": "http://10.0.0.1:99999"}, "url"),
        ({"name": "x", "url": 5}, "url"),
        ({"name": "a/b", "url": d0}, "name"),
        ({"name": "", "url": d0}, "name"),
        ({"url": d0}, "name"),
        ({"name": "x", "url": d0, "role": "boss"}, "role"),
        ({"name": "x", "url": d0, "models": "sim-model"}, "models"),
        ({"name": "x", "url": d0, "weight": 3}, "weight"),
    ]
    for body, param in bad:
        status, out = await call(c, "POST", "/admin/backends", body)
        assert status == 400, (body, out)
        assert out["error"]["param"] == param, (body, out)
        assert out["error"]["type"] == "BadRequestError", (body, out)
    status, out = await call(c, "POST", "/admin/backends", b"{not json")
    assert status == 400
    assert "JSON" in out["error"]["message"]
    status, out = await call(c, "POST", "/admin/backends", {"name": "d0", "url": d0})
    assert status == 409
    assert out["error"]["param"] == "name"
    # Only the operator: a client key does not open the admin routes.
    status, out = await call(
        c, "POST", "/admin/backends", {"name": "x", "url": d0}, headers={"Authorization": "Bearer sk-client"}
    )
    assert status == 401, out
    status, out = await call(c, "DELETE", "/admin/backends/d0", headers={})
    assert status == 401, out
    status, out = await call(c, "DELETE", "/admin/backends/nope")
    assert status == 404
    assert out["error"]["param"] == "name"
    assert set(c.registry.states) == {"d0"}


async def test_admin_fleet_routes_do_not_exist_without_an_admin_key(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    status, out = await call(c, "POST", "/admin/backends", {"name": "x", "url": c.engines["d0"].url})
    assert status == 404, out
    status, out = await call(c, "DELETE", "/admin/backends/d0")
    assert status == 404, out
    assert set(c.registry.states) == {"d0"}


@pytest.mark.parametrize(
    ("strategy", "stream"), [("round_robin", False), ("probe", False), ("probe", True), ("round_robin", "whole")]
)
async def test_a_backend_removed_between_plan_and_send_fails_over(
    make_cluster: MakeCluster, strategy: str, stream: bool | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain that ends right after a request was planned (the plan names a backend that is
    gone by the time its leg opens): the leg fails like a dead engine and goes elsewhere."""
    c = await make_cluster(decoders=2, routing={"strategy": strategy})
    state = c.state
    strategy_obj = dispatcher_of(state).strategy
    planned = strategy_obj.plan
    removed: list[str] = []

    def plan_then_lose_its_engine(
        query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()
    ) -> Plan:
        # The first plan names an engine (the direct choice or the first probe, whichever the
        # strategy made); that engine's drain ends and it is forgotten before the leg opens.
        plan = planned(query, snap, exclude)
        if not removed:
            name = plan.direct or plan.probes[0]
            registry_of(state).set_draining(name, True)
            registry_of(state).remove(name)  # idle: forgotten at once
            removed.append(name)
        return plan

    monkeypatch.setattr(strategy_obj, "plan", plan_then_lose_its_engine)
    body = {"model": MODEL, "prompt": "planned before the removal", "max_tokens": 3}
    if stream == "whole":  # n > 1: answered whole by one engine, through the forwarder
        status, out = await c.complete({**body, "n": 2, "temperature": 1.0})
        assert status == 200, out
        assert len(out["choices"]) == 2, out
    elif stream:
        status, events = await c.stream(body)
        assert status == 200, events
        assert events[-1] == "[DONE]", events
    else:
        status, out = await c.complete(body)
        assert status == 200, out
    assert removed
    assert removed[0] not in registry_of(state).states
