"""vLLM's forwarded routes get the admission and the body rules of a generation: the
router's own fields never reach an engine, GET routes are rate limited and take a slot,
and the body's `priority` follows the key's max_priority.

The upstream is a few lines of aiohttp that record what they receive (the simulator has
no /v1/responses), registered as the router's only backend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from router.config.parse import parse_config
from router.server.app import build_app

MODEL = "recorded-model"
KEY, PLAIN_KEY, SLOW_KEY = "key-open", "key-plain", "key-slow"
MAX_CONCURRENT = 4


@dataclass
class Recorder:
    bodies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    running: int = 0
    most_running: int = 0
    get_delay_s: float = 0.0

    def app(self) -> web.Application:
        async def record(request: web.Request) -> web.Response:
            self.bodies.setdefault(request.path, []).append(orjson.loads(await request.read()))
            return web.json_response({"object": "recorded", "path": request.path})

        async def version(request: web.Request) -> web.Response:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            try:
                await asyncio.sleep(self.get_delay_s)
            finally:
                self.running -= 1
            return web.json_response({"version": "0.32.0"})

        app = web.Application()
        for path in ("/v1/responses", "/v1/embeddings", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"):
            app.router.add_post(path, record)
        app.router.add_get("/version", version)
        app.router.add_get("/tokenizer_info", version)

        async def health(_: web.Request) -> web.Response:
            return web.Response()

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="")

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL}]})

        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        return app


async def _serve(app: web.Application, **kw: Any) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, **kw)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


# The fixture's value: the upstream's recorder, a client session, the router's URL.
Routed = tuple[Recorder, aiohttp.ClientSession, str]


@pytest.fixture
async def routed() -> AsyncIterator[Routed]:
    rec = Recorder()
    engine, engine_url = await _serve(rec.app())
    cfg = parse_config(
        {
            "server": {
                "port": 0,
                "max_concurrent_requests": MAX_CONCURRENT,
                "max_queued_requests": 1024,
                "queue_timeout_s": 60.0,
            },
            "tenants": [
                {"name": "open", "api_key": KEY, "max_priority": 10},
                {"name": "plain", "api_key": PLAIN_KEY},  # max_priority 0
                {"name": "slow", "api_key": SLOW_KEY, "requests_per_s": 2, "burst": 2},
            ],
            "backends": [{"name": "rec", "url": engine_url}],
            "health": {"scrape_interval_s": 30},
        }
    )
    router, url = await _serve(build_app(cfg, start_engines=False), handler_cancellation=True)
    async with aiohttp.ClientSession() as session:
        yield rec, session, url
    await router.cleanup()
    await engine.cleanup()


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


HOSTILE: dict[str, Any] = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.66.66.66", "remote_port": 5600},
    "ec_transfer_params": {"do_remote_encode": True},
    "cache_hit_threshold": 0.0,
    "vllm_xargs": {"kv_transfer_params": "10.66.66.66", "ec_transfer_params": "x", "cache_hit_threshold": 1, "k": 2},
}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"model": MODEL, "input": "hello", "request_id": "resp-mine", "priority": 3}),
        ("/v1/embeddings", {"model": MODEL, "input": ["a", "b"]}),
    ],
)
async def test_forwarded_bodies_reach_the_engine_without_the_routers_fields(
    routed: Routed, path: str, body: dict[str, Any]
) -> None:
    rec, session, url = routed
    async with session.post(url + path, json={**body, **HOSTILE}, headers=_auth()) as r:
        assert r.status == 200, await r.text()
    async with session.post(url + path, json=body, headers=_auth()) as r:  # nothing to strip
        assert r.status == 200, await r.text()
    stripped, clean = rec.bodies[path]
    if path == "/v1/responses":
        # Placed like a generation: the router's own threshold, 0, so no engine-wide
        # default rejects it (router/server/responses.py).
        zero = {"cache_hit_threshold": 0.0}
        assert stripped == {**body, **zero, "vllm_xargs": {"k": 2, **zero}}
        assert clean == {**body, **zero, "vllm_xargs": zero}
        return
    assert stripped == {**body, "vllm_xargs": {"k": 2}}
    assert clean == body


async def test_a_messages_body_only_the_engine_converts_goes_to_its_route_stripped(routed: Routed) -> None:
    rec, session, url = routed
    # An inline system turn: vLLM merges it or not by the model's template, so the router
    # does not convert this body (router/admission/messages_request.py).
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "system", "content": "s"}]}
    async with session.post(url + "/v1/messages", json={**body, **HOSTILE}, headers=_auth()) as r:
        assert r.status == 200, await r.text()
    assert rec.bodies["/v1/messages"] == [{**body, "vllm_xargs": {"k": 2}}]
    # Its token count is forwarded as vLLM's other routes are.
    async with session.post(url + "/v1/messages/count_tokens", json={**body, **HOSTILE}, headers=_auth()) as r:
        assert r.status == 200, await r.text()
    assert rec.bodies["/v1/messages/count_tokens"] == [{**body, "vllm_xargs": {"k": 2}}]


async def test_a_body_priority_earlier_than_the_key_may_ask_is_refused_before_any_engine(routed: Routed) -> None:
    rec, session, url = routed
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/embeddings", {"model": MODEL, "input": "a"}),
        ("/v1/responses", {"model": MODEL, "input": "a"}),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1}),
    ]
    for path, body in cases:
        for key, priority in [(KEY, -11), (PLAIN_KEY, -1), (KEY, -100), (KEY, "-100")]:
            async with session.post(url + path, json={**body, "priority": priority}, headers=_auth(key)) as r:
                err = (await r.json())["error"]
                assert r.status == 400, (path, key, priority, err)
                assert err["param"] == "priority"
    # (the router's own threshold check of the engine posts to /v1/completions)
    assert not [b for bodies in rec.bodies.values() for b in bodies if "priority" in b], rec.bodies
    async with session.post(
        url + "/v1/embeddings", json={"model": MODEL, "input": "a", "priority": -10}, headers=_auth()
    ) as r:
        assert r.status == 200
    assert rec.bodies["/v1/embeddings"] == [{"model": MODEL, "input": "a", "priority": -10}]


@pytest.mark.parametrize("path", ["/version", "/tokenizer_info"])
async def test_get_routes_are_held_to_the_tenants_rate(routed: Routed, path: str) -> None:
    _, session, url = routed
    statuses = []
    for _ in range(10):
        async with session.get(url + path, headers=_auth(SLOW_KEY)) as r:
            statuses.append(r.status)
            if r.status == 429:
                assert "Retry-After" in r.headers
                assert "slow" in (await r.json())["error"]["message"]
    assert statuses[:2] == [200, 200]
    assert statuses.count(429) >= 7, statuses
    async with session.get(url + path, headers=_auth()) as r:  # another key is not held back
        assert r.status == 200
    async with session.get(url + path) as r:
        assert r.status == 401


async def test_concurrent_get_routes_never_exceed_the_routers_slots(routed: Routed) -> None:
    rec, session, url = routed
    rec.get_delay_s = 0.05

    async def get(path: str) -> int:
        async with session.get(url + path, headers=_auth()) as r:
            await r.read()
            return r.status

    statuses = await asyncio.gather(*(get(("/version", "/tokenizer_info")[i % 2]) for i in range(60)))
    assert statuses == [200] * 60
    assert rec.most_running == MAX_CONCURRENT
