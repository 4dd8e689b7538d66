"""The bytes of request bodies in flight (router/admission/body_budget.py): a byte
semaphore, oldest first, 429 past the wait."""

from __future__ import annotations

import asyncio

import pytest

from router.admission.body_budget import BodyBudget
from router.errors import RouterError
from support.polling import eventually


async def test_bodies_within_the_budget_go_at_once_and_are_given_back() -> None:
    b = BodyBudget(100, wait_s=5)
    async with b.hold(60), b.hold(40):
        assert b.held == 100
    assert b.held == 0


async def test_a_body_past_the_budget_waits_for_one_to_end_oldest_first() -> None:
    b = BodyBudget(100, wait_s=5)
    order: list[str] = []
    first = b.hold(80)
    await first.__aenter__()

    async def take(name: str, size: int) -> None:
        async with b.hold(size):
            order.append(name)

    big = asyncio.create_task(take("big", 50))
    await eventually(lambda: len(b._waiters) == 1, 5, "the big body waiting")
    small = asyncio.create_task(take("small", 10))  # would fit, but the big one came first
    await eventually(lambda: len(b._waiters) == 2, 5, "the small body waiting behind it")
    assert order == []
    await first.__aexit__(None, None, None)
    await asyncio.gather(big, small)
    assert order == ["big", "small"]
    assert b.held == 0


async def test_a_body_that_waits_too_long_gets_429_naming_the_key_and_leaves_the_queue() -> None:
    b = BodyBudget(100, wait_s=0.05)
    async with b.hold(100):
        with pytest.raises(RouterError) as e:
            async with b.hold(1):
                pass
    assert e.value.status == 429
    assert "server.max_body_bytes_in_flight" in e.value.message
    assert not b._waiters
    assert b.held == 0


async def test_a_cancelled_waiter_leaves_no_bytes_held() -> None:
    b = BodyBudget(100, wait_s=5)
    hold = b.hold(100)
    await hold.__aenter__()
    waiter = asyncio.create_task(b._acquire(30))
    await eventually(lambda: len(b._waiters) == 1, 5, "the waiter queued")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await hold.__aexit__(None, None, None)
    assert b.held == 0
    assert not b._waiters


async def test_a_body_larger_than_the_budget_holds_the_whole_budget_not_more() -> None:
    b = BodyBudget(100, wait_s=5)
    async with b.hold(1000):
        assert b.held == 100
