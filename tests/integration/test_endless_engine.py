"""An engine whose bodies never end: every read of an engine's body that is not a stream
has a byte bound (router/engine/client.py), and ends in a clean error: a failed check for
`/metrics`, `/health` and `/v1/models` (the engine is skipped, the router keeps serving), a
502 naming the bound for a client's non-streamed answer.

The engine is a few lines of aiohttp writing as fast as the router reads: neither vLLM nor
the simulator misbehaves like this on purpose.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.config.parse import parse_config
from router.engine.client import MAX_ANSWER_BYTES, MAX_CHECK_BYTES
from router.server.app import ROUTER_KEY, build_app
from router.server.state import RouterState
from support.cluster import MODEL
from support.polling import eventually
from support.ports import serve_on_free_port

_PIECE = b"# " + b"x" * (64 * 1024 - 3) + b"\n"


@dataclass
class Endless:
    """Which of the engine's routes write forever, and how much they wrote."""

    routes: frozenset[str]
    written: int = 0


async def _endless_engine(endless: Endless) -> tuple[web.AppRunner, str]:
    async def answer(request: web.Request, whole: bytes, content_type: str, counted: bool = True) -> web.StreamResponse:
        if request.path not in endless.routes:
            return web.Response(body=whole, content_type=content_type)
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        await resp.prepare(request)
        await resp.write(whole[:-1])  # the start of a plausible body that never ends
        try:
            while True:
                await resp.write(_PIECE)
                endless.written += len(_PIECE) if counted else 0
        except ConnectionError:  # the router closed the connection: what ends this
            return resp

    async def health(request: web.Request) -> web.StreamResponse:
        return await answer(request, b"\n", "text/plain")

    async def metrics(request: web.Request) -> web.StreamResponse:
        return await answer(request, b"vllm:num_requests_running 0\n\n", "text/plain")

    async def models(request: web.Request) -> web.StreamResponse:
        return await answer(request, b'{"object": "list", "data": [{"id": "%s"}]}' % MODEL.encode(), "application/json")

    async def completions(request: web.Request) -> web.StreamResponse:
        # The router's capability check writes nothing to `written`: the client's answer does.
        counted = b"threshold check" not in await request.read()
        return await answer(request, b'{"id": "cmpl-x", "choices": [{"text": "', "application/json", counted)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return await serve_on_free_port(app)


@pytest.fixture
async def make_router() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def make(endless: Endless) -> tuple[RouterState, str]:
        engine, engine_url = await _endless_engine(endless)
        runners.append(engine)
        cfg = parse_config(
            {
                "server": {"port": 0},
                "backends": [{"name": "e", "url": engine_url, "models": [MODEL]}],
                # One attempt: what the engine wrote is what one answer cost.
                "routing": {"strategy": "round_robin", "max_retries": 0},
                "health": {"scrape_interval_s": 0.2, "check_interval_s": 0.2},
            }
        )
        app = build_app(cfg, start_engines=False)
        router, url = await serve_on_free_port(app, cancel_handlers=True)
        runners.insert(0, router)
        return app[ROUTER_KEY], url

    try:
        yield make
    finally:
        for r in runners:
            await r.cleanup()


@pytest.mark.parametrize("route", ["/metrics", "/health", "/v1/models"])
async def test_an_endless_check_answer_is_a_failed_check_not_unbounded_memory(make_router: Any, route: str) -> None:
    endless = Endless(frozenset({route}))
    state, _ = await make_router(endless)
    assert state.registry is not None
    backend = state.registry.states["e"]
    await eventually(
        lambda: f"larger than the {MAX_CHECK_BYTES} bytes" in backend.last_error and not backend.healthy,
        10,
        "the check failing on the bound",
    )
    # The router stopped reading at the bound (and what the sockets hold), not at the timeout.
    assert endless.written < 2 * MAX_CHECK_BYTES + 16 * 2**20


async def test_an_endless_non_streamed_answer_is_a_502_naming_the_bound(make_router: Any) -> None:
    endless = Endless(frozenset({"/v1/completions"}))
    _, url = await make_router(endless)
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        async with session.post(url + "/v1/completions", json=body) as r:
            out = await r.json()
            assert r.status == 502, out
    assert f"larger than the {MAX_ANSWER_BYTES} bytes" in out["error"]["message"]
    assert endless.written < 2 * MAX_ANSWER_BYTES
