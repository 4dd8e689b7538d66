"""An engine that stalls (SIGSTOP for 1.5 s of every 3 s) answers every request and every
health check, only late: the router notices the stalls (first tokens and health checks far
later than predicted) and sends it less, while every answer stays correct.

The same load runs twice on fresh engines, with stall avoidance off
(`health.slow_engine_s = 0`) and on: the stalling engine's share of the requests must drop
well below what it got without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import TYPE_CHECKING

import aiohttp

from support.metrics import scrape_metrics
from support.processes import signal_group
from support.subprocess_cluster import MODEL, Outcome, SimProc, sim_backends, stream_request

if TYPE_CHECKING:
    from reliability.conftest import Procs

LOAD_S = 12.0
CLIENTS = 4
PAUSE_S, PERIOD_S = 1.5, 3.0


async def _stall_periodically(engine: SimProc) -> None:
    """SIGSTOP for PAUSE_S of every PERIOD_S (the fault being injected: a fixed schedule)."""
    assert engine.proc is not None
    try:
        while True:
            signal_group(engine.proc.pid, signal.SIGSTOP)
            await asyncio.sleep(PAUSE_S)
            signal_group(engine.proc.pid, signal.SIGCONT)
            await asyncio.sleep(PERIOD_S - PAUSE_S)
    finally:
        signal_group(engine.proc.pid, signal.SIGCONT)


async def _client(s: aiohttp.ClientSession, url: str, c: int, until: float) -> list[Outcome]:
    loop, out, i = asyncio.get_running_loop(), [], 0
    while loop.time() < until:
        body = {"model": MODEL, "prompt": f"client {c} request {i} " + "w " * 40, "max_tokens": 8}
        out.append(await stream_request(s, url, body, within=60.0))
        i += 1
    return out


async def _slow_seen(s: aiohttp.ClientSession, url: str, seen: set[str]) -> None:
    """Adds each backend the router's `backend_slow` gauge reads 1 for, scraped until cancelled."""
    while True:
        ms = await scrape_metrics(s, url)
        seen.update(x.labels["backend"] for x in ms.samples if x.name == "cachehit_router_backend_slow" and x.value)
        await asyncio.sleep(0.2)  # the sampling period, not a wait for a condition


async def _stalling_share(procs: Procs, slow_engine_s: float) -> tuple[float, list[Outcome], set[str]]:
    engines = {n: procs.sim("--speed", "5") for n in ("steady", "stalling")}
    router = procs.router(
        {
            "routing": {"strategy": "round_robin"},
            "health": {"scrape_interval_s": 0.5, "check_interval_s": 1.0, "slow_engine_s": slow_engine_s},
            "backends": sim_backends(engines),
        }
    )
    slow: set[str] = set()
    async with aiohttp.ClientSession() as s:
        stalls = asyncio.create_task(_stall_periodically(engines["stalling"]))
        watch = asyncio.create_task(_slow_seen(s, router.url, slow))
        try:
            until = asyncio.get_running_loop().time() + LOAD_S
            outcomes = [
                o for c in await asyncio.gather(*(_client(s, router.url, c, until) for c in range(CLIENTS))) for o in c
            ]
        finally:
            for task in (stalls, watch):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        served = {n: (await scrape_metrics(s, e.url)).value("vllm:request_success_total") for n, e in engines.items()}
    for e in engines.values():
        e.stop()
    router.stop()
    return served["stalling"] / sum(served.values()), outcomes, slow


async def test_a_stalling_engine_gets_less_traffic_and_every_answer_stays_correct(procs: Procs) -> None:
    share_without, outcomes_without, slow_without = await _stalling_share(procs, slow_engine_s=0.0)
    share_with, outcomes_with, slow_with = await _stalling_share(procs, slow_engine_s=5.0)
    print(f"stalling engine's share: {share_without:.2f} without stall avoidance, {share_with:.2f} with")
    for outcomes in (outcomes_without, outcomes_with):
        bad = [o for o in outcomes if o.kind != "completed"]
        assert not bad, bad[:5]
    assert share_with < 0.6 * share_without, (share_without, share_with)
    # The avoidance is visible where operators look: the gauge read 1 for the stalling engine.
    assert slow_without == set()
    assert "stalling" in slow_with, slow_with
