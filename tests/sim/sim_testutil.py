"""Helpers shared by the simulator tests: SSE parsing, posting, reading metrics."""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import aiohttp
import orjson


def parse_sse(raw: bytes) -> list[Any]:
    """SSE body -> list of JSON payloads, with the literal '[DONE]' kept as a string."""
    events = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        assert block.startswith(b"data: "), block
        data = block[len(b"data: "):]
        events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        raw = await r.read()
        if body.get("stream") and r.status == 200:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return r.status, parse_sse(raw)
        return r.status, orjson.loads(raw)


async def metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """Value of one sample from /metrics (0.0 when absent)."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a condition (a safety timeout only; no test asserts on elapsed time)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)
