"""The security tests' stack: a router in this test's event loop in front of a capture proxy
that records exactly what the router sends upstream (over a simulated engine), and a trap
server that no request may ever reach. The `stack` fixture is re-exported by
reliability/conftest.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy

from engine_launcher.sim import SimEngineConfig, start_sim_engine
from router.config.parse import parse_config
from router.fleet.capability import CHECK_PROMPT_PREFIX
from router.server.app import build_app
from support.ports import site_port
from support.subprocess_cluster import MODEL

CLIENT_KEY = "sk-client-1"
OTHER_CLIENT_KEY = "sk-client-two-longer"
ADMIN_KEY = "sk-admin"
BACKEND_KEY = "be-secret"


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site_port(site)


class Capture:
    """A proxy in front of a simulated engine that records each request's method, path,
    headers and body, and streams the engine's answer back untouched."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.seen: list[dict[str, Any]] = []
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if CHECK_PROMPT_PREFIX.encode() not in body:  # the router's own capability check
            self.seen.append(
                {"method": request.method, "path": request.path_qs, "headers": list(request.raw_headers), "body": body}
            )
        assert self.session is not None
        async with self.session.request(
            request.method,
            self.engine_url + request.path_qs,
            data=body or None,
            headers={"Content-Type": "application/json"},
        ) as up:
            resp = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "application/json")}
            )
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp


class Trap:
    def __init__(self) -> None:
        self.hits: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(f"{request.method} {request.path_qs}")
        return web.json_response({})


@dataclass
class Stack:
    url: str  # the router's
    port: int
    cap: Capture
    trap: Trap
    trap_port: int
    session: aiohttp.ClientSession
    cap_host: str  # the capture proxy's host:port


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    """sim engine <- capture proxy <- router (in this loop); plus a trap server."""
    closers: list[Callable[[], Awaitable[None]]] = []
    eng = await start_sim_engine(SimEngineConfig(model=MODEL, speed=50.0), port=0)
    closers.append(eng.close)
    cap = Capture(eng.url)
    cap.session = aiohttp.ClientSession()
    closers.append(cap.session.close)
    capp = web.Application()
    capp.router.add_route("*", "/{tail:.*}", cap.handle)
    crunner, cport = await serve(capp)
    closers.append(crunner.cleanup)
    trap = Trap()
    tapp = web.Application()
    tapp.router.add_route("*", "/{tail:.*}", trap.handle)
    trunner, tport = await serve(tapp)
    closers.append(trunner.cleanup)
    config = parse_config(
        {
            "server": {
                "port": 0,
                "api_keys": [CLIENT_KEY, OTHER_CLIENT_KEY],
                "admin_api_key": ADMIN_KEY,
                "max_body_bytes": 64 * 1024,
            },
            "health": {"scrape_interval_s": 0.5, "check_interval_s": 1.0},
            "backends": [{"name": "d0", "url": f"http://127.0.0.1:{cport}", "role": "decode", "api_key": BACKEND_KEY}],
        }
    )
    rrunner, rport = await serve(build_app(config, start_engines=False))
    closers.append(rrunner.cleanup)
    session = aiohttp.ClientSession()
    closers.append(session.close)
    ns = Stack(
        url=f"http://127.0.0.1:{rport}",
        port=rport,
        cap=cap,
        trap=trap,
        trap_port=tport,
        session=session,
        cap_host=f"127.0.0.1:{cport}",
    )
    try:
        yield ns
    finally:
        for close in reversed(closers):
            await close()


def auth(key: str = CLIENT_KEY) -> dict[str, Any]:
    return {"Authorization": f"Bearer {key}"}


async def post(
    st: Stack, body: dict[str, Any] | bytes, headers: dict[str, Any] | None = None, path: str = "/v1/completions"
) -> tuple[int, CIMultiDictProxy[str], bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with st.session.post(
        st.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as r:
        raw = await r.read()
        return r.status, r.headers, raw


def error_body(raw: bytes, status: int) -> dict[str, Any]:
    err: dict[str, Any] = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    return err
