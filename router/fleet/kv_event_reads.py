"""When the engines' KV-event streams are read: at once while they are quiet, on one shared
tick while events flow (`StreamReads`).

Every batch an engine publishes woke the router's event loop once, and a decoder publishes a
batch at each scheduler step that stores a block: ~300 us of router CPU a batch at 150 a
second, most of it the wake-up itself (bench/RESULTS.md). Here a stream's first batch after
a quiet stretch is read at once, so the index is current for a prompt that follows an idle
engine's first step. From then on no socket is watched: every `interval_s` one tick looks at
all of them and wakes each stream that holds batches, which reads them all; the first tick
that finds none watches the sockets again. K engines at any rate then cost at most
1 / `interval_s` wake-ups a second, and the index is at most `interval_s` behind them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("cachehit_router.kv_events")


@dataclass(slots=True)
class _Stream:
    has_batches: Callable[[], bool]  # batches wait on the socket (ZMQ's events; resets its signal)
    wake: Callable[[], None]  # the stream's reader reads them


class StreamReads:
    """The sockets of the followed streams, watched while quiet and polled on a shared tick
    while events flow. `interval_s` 0: every batch is read as it arrives."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._streams: dict[int, _Stream] = {}  # file descriptor -> stream
        self._tick: asyncio.TimerHandle | None = None  # set while events flow: nothing is watched
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def ticking(self) -> bool:
        return self._tick is not None

    def watch(self, fd: int, has_batches: Callable[[], bool], wake: Callable[[], None]) -> None:
        """Follow the socket `fd`: `wake` when `has_batches` may say yes."""
        self._loop = asyncio.get_running_loop()
        self._streams[fd] = _Stream(has_batches, wake)
        if self._tick is None:
            self._loop.add_reader(fd, self._fired, fd)

    def unwatch(self, fd: int) -> None:
        """Stop following `fd` (before its socket is closed: a new socket may reuse the number)."""
        if self._streams.pop(fd, None) is None or self._loop is None:
            return
        if self._tick is None:
            self._loop.remove_reader(fd)
        elif not self._streams:
            self._tick.cancel()
            self._tick = None

    def _fired(self, fd: int) -> None:
        stream = self._streams.get(fd)
        if stream is not None:
            stream.wake()
        if self.interval_s > 0.0 and self._tick is None and self._loop is not None:
            for other in self._streams:
                self._loop.remove_reader(other)
            self._tick = self._loop.call_later(self.interval_s, self._on_tick)

    def _on_tick(self) -> None:
        assert self._loop is not None
        flowing = False
        for stream in self._streams.values():
            try:
                waiting = stream.has_batches()
            except Exception as e:  # a socket being torn down: its reader finds out
                log.debug("KV-event socket not readable: %s", e)
                waiting = True
            if waiting:
                stream.wake()
                flowing = True
        if flowing:
            self._tick = self._loop.call_later(self.interval_s, self._on_tick)
            return
        # Quiet: watch the sockets again. ZMQ's descriptor is level-triggered for epoll
        # until its signal is read, so a batch that arrived since `has_batches` fires at once.
        self._tick = None
        for fd in self._streams:
            self._loop.add_reader(fd, self._fired, fd)
