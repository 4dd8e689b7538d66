"""Clients that hang up early leave nothing behind.

Four simulated engines and the router run as real processes; clients send a request
(streamed completion, streamed chat or non-streaming) and close the connection 0-300 ms
later, while the probe race, the fallback or the stream is under way. Afterwards the
router's per-backend in-flight counts (they feed routing: a leaked count steers requests
away from an idle engine) and its client in-flight gauge return to 0, and the engines run
nothing.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING

import aiohttp
import orjson
import pytest

from support.metrics import scrape_metrics
from support.polling import eventually
from support.subprocess_cluster import MODEL, SimProc, sim_backends

if TYPE_CHECKING:
    from reliability.conftest import Procs  # the `procs` fixture's value

STORM_REQUESTS = 1500
STORM_CONCURRENCY = 48


def _body(i: int) -> tuple[str, bytes]:
    # A few shared prefixes: some probes accept (cache hit), others reject and fall back.
    prefix = " ".join(f"p{i % 5}w{k}" for k in range(40))
    prompt = f"{prefix} request {i}"
    kind = i % 3
    if kind == 0:
        return "/v1/completions", orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 40, "stream": True})
    if kind == 1:
        return "/v1/chat/completions", orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "stream": True}
        )
    return "/v1/completions", orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 40})


async def hang_up_early(port: int, path: str, body: bytes, delay_s: float) -> None:
    """Send one request, read whatever comes for `delay_s`, then close the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        try:
            async with asyncio.timeout(delay_s):
                while await reader.read(65536):
                    pass
        except TimeoutError:
            pass
    finally:
        writer.transport.abort()


async def early_hang_up_storm(port: int, n: int, concurrency: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    plan = [(*_body(i), rng.uniform(0.0, 0.3)) for i in range(n)]
    sem = asyncio.Semaphore(concurrency)

    async def one(path: str, body: bytes, delay: float) -> None:
        async with sem:
            await hang_up_early(port, path, body, delay)

    await asyncio.gather(*(one(*p) for p in plan))


async def _engines_idle(s: aiohttp.ClientSession, engines: dict[str, SimProc]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, e in engines.items():
        ms = await scrape_metrics(s, e.url)
        out[name] = ms.value("vllm:num_requests_running") + ms.value("vllm:num_requests_waiting")
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_early_hang_ups_leak_no_inflight_count(procs: Procs) -> None:
    engines = {f"d{i}": procs.sim("--speed", "2") for i in range(4)}
    router = procs.router(
        {
            "server": {"max_concurrent_requests": 256, "max_queued_requests": 1024},
            "health": {"scrape_interval_s": 0.5, "check_interval_s": 1.0},
            "backends": sim_backends(engines),
        }
    )
    await early_hang_up_storm(router.port, STORM_REQUESTS, STORM_CONCURRENCY)
    async with aiohttp.ClientSession() as s:

        async def settled() -> tuple[float, float] | None:
            ms = await scrape_metrics(s, router.url)
            counts = (ms.value("cachehit_router_backend_inflight"), ms.value("cachehit_router_inflight_requests"))
            return counts if counts == (0, 0) else None

        # Each hung-up request is aborted within moments; a leaked count never returns.
        try:
            await eventually(settled, 30.0, "router in-flight gauges back to 0")
        finally:
            ms = await scrape_metrics(s, router.url)
            per_backend = {
                x.labels.get("backend"): x.value for x in ms.samples if x.name == "cachehit_router_backend_inflight"
            }
            print("backend in-flight after the storm:", per_backend)
        assert await eventually(lambda: _idle_or_none(s, engines), 30.0, "engines idle")
        # The router still serves.
        async with s.post(
            router.url + "/v1/completions", json={"model": MODEL, "prompt": "after the storm", "max_tokens": 4}
        ) as r:
            assert r.status == 200, await r.text()


async def _idle_or_none(s: aiohttp.ClientSession, engines: dict[str, SimProc]) -> dict[str, float] | None:
    counts = await _engines_idle(s, engines)
    return counts if not any(counts.values()) else None
