"""The bytes of request bodies held at once: `server.max_body_bytes_in_flight`.

A request's body is read once it holds a concurrency slot, and what is made of it (the
parsed body, the prompt's token ids, the bodies sent to engines) lives until its answer
ends: a few times the body's size (docs/RELIABILITY.md, "Limits and timeouts"). Slots bound
how many requests run, not how large their bodies are: 1,024 slots of 4 MiB bodies would
be tens of GiB. So each request also reserves its body's size here (its Content-Length;
`server.max_body_bytes` for a body without one) from when it holds a slot until it ends,
and waits, oldest first, while the bodies in flight would pass the budget; past
`server.queue_timeout_s` of waiting it gets 429. Small requests are never held up by the
budget unless large ones have taken it all.
"""

from __future__ import annotations

import asyncio
import collections
from types import TracebackType

from router import errors


class BodyBudget:
    """A byte semaphore, first come first served (a large body is not overtaken forever by
    small ones)."""

    def __init__(self, capacity: int, wait_s: float):
        self.capacity = capacity
        self.wait_s = wait_s
        self.held = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def hold(self, size: int) -> _Hold:
        """`async with budget.hold(n):` `n` bytes (at most the capacity) for the block."""
        return _Hold(self, min(size, self.capacity))

    async def _acquire(self, size: int) -> None:
        if not self._waiters and self.held + size <= self.capacity:
            self.held += size
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (size, fut)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(self.wait_s):
                await fut
        except BaseException as e:
            if fut.done() and not fut.cancelled():  # granted as it timed out or was cancelled
                self._release(size)
            if isinstance(e, TimeoutError):
                raise errors.too_many_requests(
                    self.wait_s,
                    "The router holds as many request bodies as server.max_body_bytes_in_flight = "
                    f"{self.capacity} bytes allows; retry later.",
                    reason="queue_timeout",
                ) from None
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()

    def _release(self, size: int) -> None:
        self.held -= size
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            size, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.held + size > self.capacity:
                return
            self._waiters.popleft()
            self.held += size
            fut.set_result(None)


class _Hold:
    __slots__ = ("_budget", "_size")

    def __init__(self, budget: BodyBudget, size: int):
        self._budget = budget
        self._size = size

    async def __aenter__(self) -> None:
        await self._budget._acquire(self._size)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._budget._release(self._size)
