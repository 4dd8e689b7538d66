"""Posting to a simulated engine (SSE, metrics and polling: the support package)."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from support.sse import parse_sse


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        raw = await r.read()
        if body.get("stream") and r.status == 200:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return r.status, parse_sse(raw)
        return r.status, orjson.loads(raw)
