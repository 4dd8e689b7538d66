"""Backpressure: at most N requests execute; a bounded queue waits for a slot.

Past `max_queued` waiting, or after `queue_timeout_s` in the queue, the request gets 429
with Retry-After. Memory stays bounded whatever the load: one small waiter per queued
request, and a fixed number of executing ones.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from . import errors


class ConcurrencyLimiter:
    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_s: float):
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def slot(self) -> "_Slot":
        """`async with limiter.slot():` holds one slot for the block. A plain async context
        manager object: @asynccontextmanager's generator costs several microseconds per
        request for the same acquire/release."""
        return _Slot(self)

    async def _acquire(self) -> None:
        if self.active < self.max_concurrent and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise errors.too_many_requests(max(1.0, self.queue_timeout_s))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                # The slot was handed over just as we gave up: pass it on.
                self._release()
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            if isinstance(exc, asyncio.TimeoutError):
                raise errors.too_many_requests(
                    self.queue_timeout_s,
                    f"The router is at capacity and no slot freed within {self.queue_timeout_s:g} s.") from None
            raise

    def _release(self) -> None:
        # Hand the slot straight to the oldest waiter; `active` stays the same.
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1


class _Slot:
    __slots__ = ("_limiter",)

    def __init__(self, limiter: ConcurrencyLimiter):
        self._limiter = limiter

    async def __aenter__(self) -> None:
        await self._limiter._acquire()

    async def __aexit__(self, *exc: object) -> bool:
        self._limiter._release()
        return False
