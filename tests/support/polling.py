"""Waiting for a condition instead of sleeping for a guessed time.

The bound (`within`, seconds) is a liveness bound for a loaded machine, never a speed check.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


def _describe(what: str | None, condition: Callable[[], Any]) -> str:
    return what or str(getattr(condition, "__name__", repr(condition)))


@overload
async def eventually(
    condition: Callable[[], Awaitable[T]], within: float = 10.0, what: str | None = None, interval: float = 0.02
) -> T: ...


@overload
async def eventually(
    condition: Callable[[], T], within: float = 10.0, what: str | None = None, interval: float = 0.02
) -> T: ...


async def eventually(
    condition: Callable[[], Any], within: float = 10.0, what: str | None = None, interval: float = 0.02
) -> Any:
    """Call `condition` (sync, or async returning an awaitable) until it returns something
    truthy, and return that. An AssertionError it raises counts as "not yet". After
    `within` seconds fails with `what`, the last value or assertion message."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        last_error = None
        try:
            last = condition()
            if inspect.isawaitable(last):
                last = await last
        except AssertionError as e:
            last, last_error = None, e
        if last_error is None and last:
            return last
        if loop.time() >= end:
            detail = f"last assertion: {last_error}" if last_error is not None else f"last value: {last!r}"
            raise AssertionError(f"{_describe(what, condition)}: not reached within {within} s ({detail})")
        await asyncio.sleep(interval)


def eventually_blocking(
    condition: Callable[[], T], within: float = 10.0, what: str | None = None, interval: float = 0.05
) -> T:
    """`eventually` for tests without an event loop (it blocks the calling thread)."""
    end = time.monotonic() + within
    while True:
        last_error = None
        try:
            last = condition()
        except AssertionError as e:
            last, last_error = None, e
        if last_error is None and last:
            return last
        if time.monotonic() >= end:
            detail = f"last assertion: {last_error}" if last_error is not None else f"last value: {last!r}"
            raise AssertionError(f"{_describe(what, condition)}: not reached within {within} s ({detail})")
        time.sleep(interval)
