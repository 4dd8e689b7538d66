"""A race cancelled by its caller (the client hung up) leaves no stream open.

Two moments are hard to hit by chance but happen about once a hundred early hang-ups:
a probe has accepted and the race is cancelled before it looked at the result, and the
race has a winner and is cancelled while it waits for the losers to stop. Done callbacks
run in the order they were added, so cancelling from a probe task's done callback hits
each moment exactly. The streams are real (simulated engines over HTTP); the check is the
backend in-flight count the registry keeps, which feeds routing, and the engine's own
running count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from router.dispatch.race import run_race
from router.engine.stream import UpstreamStream
from router.engine.wire import streamed_leg_body
from support.cluster import MODEL, Cluster, MakeCluster, long_prompt
from support.polling import eventually


async def _settled(c: Cluster, within: float = 10.0) -> dict[str, int]:
    def settled() -> dict[str, int]:
        counts = {n: s.inflight for n, s in c.registry.states.items()}
        assert not any(counts.values()), f"requests still in flight: {counts}"
        return counts

    return await eventually(settled, within, "no request in flight")


def _opener(c: Cluster, body: dict[str, Any]) -> Callable[[str], Awaitable[UpstreamStream]]:
    loop = asyncio.get_running_loop()
    # Each leg holds a LegTicket for its prompt's tokens until its stream closes.
    return c.dispatcher.placer._opener(
        "/v1/completions", streamed_leg_body(body, 0.0), loop.time() + 30.0, tokens=100, tickets={}
    )


async def test_cancelled_while_an_accepted_probe_is_unread(make_cluster: MakeCluster) -> None:
    # Two engines: a race of one runs its probe in the caller's task, where the outcome
    # goes straight to the caller and this moment does not exist.
    c = await make_cluster(decoders=2)
    open_leg = _opener(c, {"model": MODEL, "prompt": long_prompt("unread"), "max_tokens": 200})
    race: asyncio.Task[Any] | None = None

    async def open_and_arm(name: str) -> UpstreamStream:
        # The race's own completion callback was added first: it wakes the race, then this
        # one cancels it before the race runs, so the accepted probe is never looked at.
        def cancel_race(_t: object) -> None:
            assert race is not None  # started before any leg opens
            race.cancel()

        task = asyncio.current_task()
        assert task is not None
        task.add_done_callback(cancel_race)
        return await open_leg(name)

    race = asyncio.ensure_future(run_race(("d0", "d1"), open_and_arm, 10.0))
    await asyncio.gather(race, return_exceptions=True)
    assert race.cancelled()
    assert await _settled(c) == {"d0": 0, "d1": 0}
    assert await c.wait_idle(10) == {"d0": 0, "d1": 0}


async def test_cancelled_while_waiting_for_the_losers(make_cluster: MakeCluster) -> None:
    # d1 is slow to answer: it is still running when d0 wins, and the race is cancelled
    # while it waits for d1's probe to stop.
    c = await make_cluster(decoders=2, per_engine={"d1": {"speed": 0.05}})
    open_leg = _opener(c, {"model": MODEL, "prompt": long_prompt("losers"), "max_tokens": 200})
    race: asyncio.Task[Any] | None = None
    loop = asyncio.get_running_loop()

    async def open_and_arm(name: str) -> UpstreamStream:
        if name == "d0":
            # Two hops: the race wakes, picks d0, cancels d1 and waits; then the cancel.
            def cancel_race_soon(_t: object) -> None:
                assert race is not None  # started before any leg opens
                loop.call_soon(race.cancel)

            task = asyncio.current_task()
            assert task is not None
            task.add_done_callback(cancel_race_soon)
        return await open_leg(name)

    race = asyncio.ensure_future(run_race(("d0", "d1"), open_and_arm, 10.0))
    await asyncio.gather(race, return_exceptions=True)
    assert race.cancelled()
    assert await _settled(c) == {"d0": 0, "d1": 0}
    assert await c.wait_idle(10) == {"d0": 0, "d1": 0}
