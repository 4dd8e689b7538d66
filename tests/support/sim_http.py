"""Posting to a simulated engine (SSE, metrics and polling: the support package)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from engine_launcher.sim import SimEngineHandle
from support.sse import parse_sse

# What the sim suite's `make_engine` fixture gives a test: `await make_engine(**SimEngineConfig fields)`.
MakeEngine = Callable[..., Awaitable[SimEngineHandle]]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        raw = await r.read()
        if body.get("stream") and r.status == 200:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return r.status, parse_sse(raw)
        return r.status, orjson.loads(raw)
