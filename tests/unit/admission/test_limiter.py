"""Backpressure (router/admission/limiter.py): bounded concurrency, bounded queue, 429 with
Retry-After, slots shared fairly between priorities and tenants."""

from __future__ import annotations

import asyncio

import pytest

from router.admission.limiter import ConcurrencyLimiter
from router.admission.tenants import Tenant
from router.errors import RouterError
from support.polling import eventually


async def test_queue_then_429_when_full() -> None:
    lim = ConcurrencyLimiter(max_concurrent=2, max_queued=1, queue_timeout_s=5)
    release = asyncio.Event()
    order: list[int] = []

    async def job(i: int) -> None:
        async with lim.slot():
            order.append(i)
            await release.wait()

    tasks = [asyncio.create_task(job(i)) for i in range(3)]
    await eventually(lambda: lim.active == 2 and lim.queued == 1, what="two jobs running, one queued")
    with pytest.raises(RouterError) as e:
        async with lim.slot():
            pass
    assert e.value.status == 429
    assert int(e.value.headers["Retry-After"]) >= 1
    release.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert lim.active == 0
    assert lim.queued == 0


async def test_queue_timeout_gives_429_and_leaves_no_waiter() -> None:
    lim = ConcurrencyLimiter(max_concurrent=1, max_queued=10, queue_timeout_s=0.05)
    hold = asyncio.Event()

    async def holder() -> None:
        async with lim.slot():
            await hold.wait()

    t = asyncio.create_task(holder())
    await eventually(lambda: lim.active == 1, what="the holder in its slot")
    with pytest.raises(RouterError) as e:
        async with lim.slot():
            pass
    assert e.value.status == 429
    assert lim.queued == 0
    hold.set()
    await t
    assert lim.active == 0


async def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    lim = ConcurrencyLimiter(max_concurrent=1, max_queued=10, queue_timeout_s=10)
    hold = asyncio.Event()

    async def holder() -> None:
        async with lim.slot():
            await hold.wait()

    t = asyncio.create_task(holder())
    await eventually(lambda: lim.active == 1, what="the holder in its slot")

    async def waiter() -> None:
        async with lim.slot():
            pass

    w = asyncio.create_task(waiter())
    await eventually(lambda: lim.queued == 1, what="the waiter queued")
    w.cancel()
    await asyncio.gather(w, return_exceptions=True)
    hold.set()
    await t
    assert lim.active == 0
    assert lim.queued == 0
    async with lim.slot():
        assert lim.active == 1


async def _holders(
    lim: ConcurrencyLimiter, n: int, tenant: Tenant | None = None
) -> tuple[asyncio.Event, list[asyncio.Task[None]]]:
    """n tasks holding a slot each until the returned event is set."""
    release = asyncio.Event()
    started = 0

    async def hold() -> None:
        nonlocal started
        async with lim.slot(tenant):
            started += 1
            await release.wait()

    tasks = [asyncio.create_task(hold()) for _ in range(n)]
    await eventually(lambda: started >= min(n, lim.max_concurrent), what="the holders in their slots")
    return release, tasks


async def _waiter(
    lim: ConcurrencyLimiter,
    order: list[str],
    label: str,
    tenant: Tenant | None = None,
    priority: int = 0,
    hold: asyncio.Event | None = None,
) -> None:
    async with lim.slot(tenant, priority):
        order.append(label)
        if hold is not None:
            await hold.wait()


async def test_the_highest_priority_waiter_gets_the_next_slot() -> None:
    lim = ConcurrencyLimiter(max_concurrent=1, max_queued=10, queue_timeout_s=5)
    release, holders = await _holders(lim, 1)
    order: list[str] = []
    tasks = [
        asyncio.create_task(_waiter(lim, order, "low")),
        asyncio.create_task(_waiter(lim, order, "background", priority=-5)),
    ]
    await eventually(lambda: lim.queued == 2, what="low and background queued first")
    tasks.append(asyncio.create_task(_waiter(lim, order, "urgent", priority=3)))
    await eventually(lambda: lim.queued == 3, what="urgent queued behind them")
    release.set()
    await asyncio.gather(*holders, *tasks)
    assert order == ["urgent", "low", "background"]
    assert (lim.active, lim.queued) == (0, 0)


async def test_a_flooding_tenant_does_not_starve_another() -> None:
    lim = ConcurrencyLimiter(max_concurrent=2, max_queued=100, queue_timeout_s=5)
    flood, quiet = Tenant("flood"), Tenant("quiet")
    release, holders = await _holders(lim, 2, flood)
    order: list[str] = []
    hold = asyncio.Event()
    tasks = [asyncio.create_task(_waiter(lim, order, f"flood{i}", flood, hold=hold)) for i in range(20)]
    await eventually(lambda: flood.queued == 20, what="the flood queued first")
    tasks.append(asyncio.create_task(_waiter(lim, order, "quiet", quiet, hold=hold)))
    await eventually(
        lambda: lim.queued == 21 and flood.queued == 20 and quiet.queued == 1, what="quiet queued behind the flood"
    )
    release.set()  # two slots free: one for the tenant with none executing, one for flood
    await eventually(lambda: len(order) >= 2, what="two waiters in the freed slots")
    assert "quiet" in order
    assert len(order) == 2
    hold.set()
    await asyncio.gather(*holders, *tasks)
    assert (lim.active, lim.queued, flood.active, flood.queued, quiet.active) == (0, 0, 0, 0, 0)


async def test_a_tenant_at_its_own_limit_waits_while_others_start() -> None:
    lim = ConcurrencyLimiter(max_concurrent=10, max_queued=10, queue_timeout_s=5)
    capped, other = Tenant("capped", max_concurrent=1, max_queued=1), Tenant("other")
    release, holders = await _holders(lim, 1, capped)
    order: list[str] = []
    waiting = asyncio.create_task(_waiter(lim, order, "capped2", capped))
    # a free slot, yet capped waits
    await eventually(lambda: capped.queued == 1 and lim.active == 1, what="capped2 queued")
    async with lim.slot(other):  # at once
        pass
    with pytest.raises(RouterError) as e:  # its own queue (max_queued = 1) is full
        async with lim.slot(capped):
            pass
    assert e.value.status == 429
    assert e.value.reason == "tenant_queue"
    assert "'capped'" in e.value.message
    assert int(e.value.headers["Retry-After"]) >= 1
    release.set()
    await asyncio.gather(*holders, waiting)
    assert order == ["capped2"]
    assert (lim.active, capped.active, capped.queued) == (0, 0, 0)


async def test_a_tenant_over_its_rate_gets_429_with_retry_after() -> None:
    lim = ConcurrencyLimiter(max_concurrent=10, max_queued=10, queue_timeout_s=5)
    t = Tenant("metered", requests_per_s=0.5, burst=2)
    for _ in range(2):
        async with lim.slot(t):
            pass
    with pytest.raises(RouterError) as e:
        async with lim.slot(t):
            pass
    assert e.value.status == 429
    assert e.value.reason == "rate"
    assert e.value.headers["Retry-After"] == "2"
    assert "0.5 requests per second" in e.value.message
    async with lim.slot(Tenant("other")):  # others are not affected
        pass
    assert (lim.active, t.active) == (0, 0)


async def test_waiters_that_give_up_leave_no_count_behind() -> None:
    lim = ConcurrencyLimiter(max_concurrent=1, max_queued=100, queue_timeout_s=0.01)
    t = Tenant("t", max_concurrent=1, max_queued=100)
    release, holders = await _holders(lim, 1, t)
    for _ in range(50):
        with pytest.raises(RouterError):
            async with lim.slot(t):
                pass
    assert (t.queued, lim.queued) == (0, 0)
    assert len(lim._waiting.get(t, [])) <= 16  # pruned as they gave up
    release.set()
    await asyncio.gather(*holders)
    assert (lim.active, t.active) == (0, 0)
