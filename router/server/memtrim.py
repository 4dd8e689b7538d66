"""Giving memory back to the system once the router is idle.

After a burst (hundreds of streams, slow readers) the C allocator keeps the freed heap:
the router's RSS stays at its peak although nothing uses it. glibc's malloc_trim returns
the free pages; it costs milliseconds on a large heap, so it runs only once the router has
had no request in flight for `IDLE_S`, and once per burst. Memory freed outside any
request (a connection closed with a large request head half received:
router/server/connections.py) asks for a trim too (`freed`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

IDLE_S = 2.0  # no request in flight for this long before trimming


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another C library: nothing to do)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class IdleTrimmer:
    """`busy()` when the first request in flight starts, `idle()` when the last one ends.

    One timer at a time, not one a request: requests one after another make the router
    busy and idle once each, and a timer armed and cancelled for each cost a few
    microseconds a request. The timer is left running while requests come and go; when
    it fires it trims if the router has been idle for `idle_s` since, or waits again."""

    def __init__(self, trim: Callable[[int], int] | None = None, idle_s: float = IDLE_S):
        self._trim = trim if trim is not None else malloc_trim()
        self._idle_s = idle_s
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dirty = False  # requests ran since the last trim
        self._busy = False  # a request is in flight
        self._idle_since = 0.0  # loop time the last request ended (or memory was freed while idle)

    def busy(self) -> None:
        self._dirty = True
        self._busy = True

    def idle(self) -> None:
        self._busy = False
        if self._trim is not None:
            self._idle_since = self._time()
            self._schedule()

    def freed(self) -> None:
        """Memory was freed outside a request: trim once no request is in flight."""
        self._dirty = True
        if not self._busy and self._timer is None and self._trim is not None:
            self._idle_since = self._time()
            self._schedule()

    def _time(self) -> float:
        loop = self._loop
        if loop is None:  # held: asyncio.get_running_loop() costs a getpid() each call
            loop = self._loop = asyncio.get_running_loop()
        return loop.time()

    def _schedule(self) -> None:
        if self._dirty and self._timer is None and self._loop is not None:
            self._timer = self._loop.call_at(self._idle_since + self._idle_s, self._run)

    def _run(self) -> None:
        self._timer = None
        if self._busy:
            return  # the request in flight schedules the trim again when it ends
        if self._time() < self._idle_since + self._idle_s:
            self._schedule()  # a request came and went meanwhile: idle_s from its end
            return
        self._dirty = False
        assert self._trim is not None
        self._trim(0)
