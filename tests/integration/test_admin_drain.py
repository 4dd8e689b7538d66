"""An operator takes a backend out of rotation and puts it back (admin API).

POST /admin/backends/{name}/drain: no new request or leg goes there (not even when every
other backend is down: draining beats panic routing), the requests it serves finish;
POST /admin/backends/{name}/enable undoes it. Only with server.admin_api_key, only for
configured backend names.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from support.cluster import MODEL, Cluster, MakeCluster, long_prompt
from support.polling import eventually

ADMIN = {"Authorization": "Bearer sk-admin"}


async def admin(c: Cluster, path: str, headers: dict[str, str] = ADMIN) -> tuple[int, dict[str, Any]]:
    async with c.session.post(c.url + path, headers=headers) as r:
        answer: dict[str, Any] = orjson.loads(await r.read())
        return r.status, answer


async def requests_seen(c: Cluster) -> dict[str, float]:
    # Every request an engine finished, rejections included: probes count too.
    return await c.engine_metrics("vllm:request_success_total")


async def test_drained_backend_gets_no_new_requests_while_its_stream_finishes(make_cluster: MakeCluster) -> None:
    # Every request races: the holder's return to rotation shows as a probe hit.
    c = await make_cluster(
        decoders=2, server={"admin_api_key": "sk-admin"}, routing={"race": "always"}, sim={"speed": 1.0}
    )
    warm = {"model": MODEL, "prompt": long_prompt("drain", 400), "max_tokens": 4}
    status, out = await c.complete(warm)  # the prompt's cache now lives on one engine
    assert status == 200, out
    generated = await c.engine_metrics("vllm:generation_tokens_total")  # rejections generate none
    holder = next(n for n, v in generated.items() if v > 0)

    # A long stream on the holder is running when the operator drains it.
    stream = asyncio.create_task(c.stream({**warm, "max_tokens": 60}))
    await eventually(lambda: c.engine_running()[holder], what="the stream running on the holder", interval=0.005)
    status, view = await admin(c, f"/admin/backends/{holder}/drain")
    assert status == 200
    assert view["name"] == holder
    assert view["draining"] is True
    assert c.router_metric("cachehit_router_backend_draining", backend=holder) == 1

    before = await requests_seen(c)
    for i in range(4):  # the warm prompt too: its cache is on the drained engine
        status, out = await c.complete(warm if i == 0 else {**warm, "prompt": long_prompt(f"n{i}", 50)})
        assert status == 200, out
    after = await requests_seen(c)
    other = "d1" if holder == "d0" else "d0"
    # The drained engine finished only the stream it had; the other took every new request.
    assert after[other] - before[other] >= 4
    status, events = await stream
    assert status == 200
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    assert sum(1 for e in events[:-1] if e.get("choices") and e["choices"][0].get("text")) == 60
    assert (await requests_seen(c))[holder] == before[holder] + 1  # the stream, nothing new

    async with c.session.get(c.url + "/ready") as r:
        assert r.status == 200  # the other engine still takes requests

    # Back in rotation: the warm prompt is a probe hit on it again.
    status, view = await admin(c, f"/admin/backends/{holder}/enable")
    assert status == 200
    assert view["draining"] is False
    assert c.router_metric("cachehit_router_backend_draining", backend=holder) == 0
    hits = c.routes()["probe_hit"]
    status, out = await c.complete(warm)
    assert status == 200
    assert c.routes()["probe_hit"] == hits + 1
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192


async def test_all_drained_is_503_and_not_ready(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, server={"admin_api_key": "sk-admin"})
    for name in ("d0", "d1"):
        assert (await admin(c, f"/admin/backends/{name}/drain"))[0] == 200
    before = await requests_seen(c)
    status, out = await c.complete({"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert status == 503, out
    assert out["error"]["message"] == f"No healthy backend is available for model `{MODEL}`; retry later."
    assert await requests_seen(c) == before  # panic routing did not use them
    async with c.session.get(c.url + "/ready") as r:
        assert r.status == 503
    async with c.session.get(c.url + "/admin/backends", headers=ADMIN) as r:
        assert [b["draining"] for b in orjson.loads(await r.read())] == [True, True]
    assert (await admin(c, "/admin/backends/d1/enable"))[0] == 200
    status, out = await c.complete({"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert status == 200, out


async def test_drain_needs_the_admin_key_and_a_configured_name(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1, server={"admin_api_key": "sk-admin"})
    for headers in ({}, {"Authorization": "Bearer sk-admi"}):
        status, body = await admin(c, "/admin/backends/d0/drain", headers)
        assert status == 401
        assert body["error"]["type"] == "AuthenticationError"
    status, body = await admin(c, "/admin/backends/http%3A%2F%2Fevil:80/drain")
    assert status == 404
    assert body["error"]["param"] == "name"
    assert "configured: d0" in body["error"]["message"]
    assert c.registry.states["d0"].draining is False
    plain = await make_cluster(decoders=1)  # no admin key: no admin routes
    status, _ = await admin(plain, "/admin/backends/d0/drain", {"Authorization": "Bearer "})
    assert status == 404
