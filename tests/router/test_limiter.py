"""Backpressure: bounded concurrency, bounded queue, 429 with Retry-After."""
import asyncio

import pytest

from router.errors import RouterError
from router.limiter import ConcurrencyLimiter


async def test_queue_then_429_when_full():
    lim = ConcurrencyLimiter(max_concurrent=2, max_queued=1, queue_timeout_s=5)
    release = asyncio.Event()
    order = []

    async def job(i):
        async with lim.slot():
            order.append(i)
            await release.wait()

    tasks = [asyncio.create_task(job(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert lim.active == 2 and lim.queued == 1
    with pytest.raises(RouterError) as e:
        async with lim.slot():
            pass
    assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
    release.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert lim.active == 0 and lim.queued == 0


async def test_queue_timeout_gives_429_and_leaves_no_waiter():
    lim = ConcurrencyLimiter(max_concurrent=1, max_queued=10, queue_timeout_s=0.05)
    hold = asyncio.Event()

    async def holder():
        async with lim.slot():
            await hold.wait()

    t = asyncio.create_task(holder())
    await asyncio.sleep(0)
    with pytest.raises(RouterError) as e:
        async with lim.slot():
            pass
    assert e.value.status == 429
    assert lim.queued == 0
    hold.set()
    await t
    assert lim.active == 0


async def test_cancelled_waiter_does_not_leak_a_slot():
    lim = ConcurrencyLimiter(max_concurrent=1, max_queued=10, queue_timeout_s=10)
    hold = asyncio.Event()

    async def holder():
        async with lim.slot():
            await hold.wait()

    t = asyncio.create_task(holder())
    await asyncio.sleep(0)

    async def waiter():
        async with lim.slot():
            pass

    w = asyncio.create_task(waiter())
    await asyncio.sleep(0.01)
    w.cancel()
    await asyncio.gather(w, return_exceptions=True)
    hold.set()
    await t
    assert lim.active == 0 and lim.queued == 0
    async with lim.slot():
        assert lim.active == 1
