"""Admission: at most N requests execute; a bounded queue waits for a slot, shared fairly.

Past `max_queued` waiting, or after `queue_timeout_s` in the queue, the request gets 429
with Retry-After. Memory stays bounded whatever the load: one small waiter per queued
request, and a fixed number of executing ones.

Fair sharing (router/admission/tenants.py): each request belongs to a tenant (its API key). A
tenant over its request rate gets 429 at once; one at its own concurrency limit waits
(at most its own queue bound) while the others go ahead. A freed slot goes to the waiter
with the highest priority, then to the tenant with the fewest requests executing, then
to the oldest request: a tenant that floods the queue cannot starve the others.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Any

from router import errors
from router.admission.tenants import ANONYMOUS, Tenant


class ConcurrencyLimiter:
    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_s: float):
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self.queued = 0
        self.anonymous = Tenant(ANONYMOUS)
        # Tenants with waiters -> their heap of [-priority, arrival number, future].
        self._waiting: dict[Tenant, list[list[Any]]] = {}
        self._arrivals = itertools.count()

    def slot(self, tenant: Tenant | None = None, priority: int = 0) -> _Slot:
        """`async with limiter.slot(tenant, priority):` holds one slot for the block. A
        plain async context manager object: @asynccontextmanager's generator costs several
        microseconds per request for the same acquire/release."""
        return _Slot(self, tenant or self.anonymous, priority)

    async def _acquire(self, t: Tenant, priority: int) -> None:
        if t.bucket is not None:
            wait = t.bucket.take(asyncio.get_running_loop().time())
            if wait > 0:
                raise errors.too_many_requests(
                    wait,
                    f"API key '{t.name}' is over its limit of {t.bucket.rate:g} requests per second "
                    "(tenants.requests_per_s).",
                    reason="rate",
                )
        # Whenever a slot is free, no waiter that could take it is left (_dispatch runs
        # on every release): a free slot is this request's if its tenant may start one.
        if self.active < self.max_concurrent and t.may_start():
            self._grant(t)
            return
        if self.queued >= self.max_queued:
            raise errors.too_many_requests(max(1.0, self.queue_timeout_s), reason="queue")
        if not t.may_queue():
            raise errors.too_many_requests(
                max(1.0, self.queue_timeout_s),
                f"API key '{t.name}' has {t.active} requests executing and {t.queued} waiting, its limits "
                "(tenants.max_concurrent_requests, tenants.max_queued_requests).",
                reason="tenant_queue",
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting.setdefault(t, []), [-priority, next(self._arrivals), fut])
        t.queued += 1
        self.queued += 1
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                # The slot was handed over just as we gave up: pass it on.
                self._release(t)
            else:
                fut.cancel()
                t.queued -= 1
                self.queued -= 1
                self._prune(t)
            if isinstance(exc, asyncio.TimeoutError):
                raise errors.too_many_requests(
                    self.queue_timeout_s,
                    f"The router is at capacity and no slot freed within {self.queue_timeout_s:g} s.",
                    reason="queue_timeout",
                ) from None
            raise

    def _grant(self, t: Tenant) -> None:
        self.active += 1
        t.active += 1

    def _release(self, t: Tenant) -> None:
        self.active -= 1
        t.active -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to waiters: highest priority, then the tenant with the fewest
        requests executing, then the oldest request (the number of tenants waiting is
        small; each one's own queue is a heap)."""
        while self.active < self.max_concurrent and self._waiting:
            best, best_key = None, None
            for t in list(self._waiting):
                heap = self._waiting[t]
                while heap and heap[0][2].done():  # gave up (timeout, hang-up)
                    heapq.heappop(heap)
                if not heap:
                    del self._waiting[t]
                    continue
                if not t.may_start():
                    continue
                key = (heap[0][0], t.active, heap[0][1])
                if best_key is None or key < best_key:
                    best, best_key = t, key
            if best is None:
                return
            fut = heapq.heappop(self._waiting[best])[2]
            best.queued -= 1
            self.queued -= 1
            self._grant(best)
            fut.set_result(None)

    def _prune(self, t: Tenant) -> None:
        """Drop the waiters that gave up from a tenant's heap once they are the most of it
        (a tenant held at its limit would otherwise collect them)."""
        heap = self._waiting.get(t)
        if heap is not None and len(heap) > 2 * t.queued + 16:
            heap[:] = [e for e in heap if not e[2].done()]
            heapq.heapify(heap)
            if not heap:
                del self._waiting[t]


class _Slot:
    __slots__ = ("_limiter", "_priority", "_tenant")

    def __init__(self, limiter: ConcurrencyLimiter, tenant: Tenant, priority: int):
        self._limiter = limiter
        self._tenant = tenant
        self._priority = priority

    async def __aenter__(self) -> None:
        await self._limiter._acquire(self._tenant, self._priority)

    async def __aexit__(self, *exc: object) -> None:  # None: exceptions pass through
        self._limiter._release(self._tenant)
