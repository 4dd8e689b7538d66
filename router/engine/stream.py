"""One streamed engine leg: SSE chunks parsed as they arrive, under the leg's deadlines.

`next_chunk()` returns the next parsed chunk (a dict) or None after `[DONE]`;
`next_chunks()` everything already received; `next_payloads()` the same unparsed (the
caller reads what it needs on the bytes and `parse`s the rest); `abort()` drops the connection at once, which
is how vLLM (and the simulator) learn that the client went away and abort the request.
A missed deadline (first chunk, idle between chunks, total), a broken connection, an
engine's error event or an unreadable chunk is an `UpstreamError` of its kind.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import orjson

from router.config.schema import TimeoutsConfig
from router.engine.errors import (
    BROKEN,
    ENGINE_ERROR,
    FIRST_TOKEN_TIMEOUT,
    IDLE_TIMEOUT,
    PROTOCOL,
    TOTAL_TIMEOUT,
    UpstreamError,
)
from router.engine.sse import SSEDecoder, SSEError
from router.observability import tracing


class LegSource(Protocol):
    """Where a leg's events come from: a hand-written connection (router/engine/http1.py)
    or an aiohttp response (`AiohttpSource`, for https:// engines)."""

    events: deque[bytes]  # the events received and not yet taken
    failure: tuple[str, str] | None  # (kind, detail) once the leg broke or its body ended
    # Called with `events` as they arrive while the reader waits, where the source can
    # (the hand-written connection); pops what it took, True when it took them all.
    direct: Callable[[deque[bytes]], bool] | None
    # Called with a read of a chunked body before it is read into events, where the
    # source can: the bytes it took of the read's start.
    direct_chunked: Callable[[bytes], int] | None
    # A first read's body past its leading chunks, not yet read (router/engine/http1.py).
    held: bytes

    def wait(self) -> Awaitable[None]: ...  # done once more events came or the leg ended
    def read_held(self, offer: Callable[[bytes], int]) -> None: ...  # `held` read: `offer` first
    def release(self) -> None: ...  # the connection back to its pool
    def close(self) -> None: ...  # dropped: the engine aborts the request


class AiohttpSource:
    """An aiohttp response read as a leg's events."""

    __slots__ = ("_decoder", "_resp", "direct", "direct_chunked", "events", "failure", "held")

    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp
        self._decoder = SSEDecoder()
        self.events: deque[bytes] = deque()
        self.failure: tuple[str, str] | None = None
        self.direct: Callable[[deque[bytes]], bool] | None = None  # never called: read in `wait`
        self.direct_chunked: Callable[[bytes], int] | None = None  # never called: aiohttp de-chunks
        self.held = b""  # never any: aiohttp reads the body

    def read_held(self, offer: Callable[[bytes], int]) -> None:
        pass  # nothing is held

    async def wait(self) -> None:
        try:
            data = await self._resp.content.readany()
        except (aiohttp.ClientError, ConnectionError) as e:
            self.failure = (BROKEN, f"connection lost: {e!r}")
            return
        if not data:
            # EOF before [DONE] (which would have been consumed first): a broken leg.
            self.failure = (BROKEN, "stream ended without [DONE]")
            return
        try:
            self.events.extend(self._decoder.feed(data))
        except SSEError as e:
            self.failure = (PROTOCOL, str(e))

    def release(self) -> None:
        self._resp.release()

    def close(self) -> None:
        self._resp.close()


class UpstreamStream:
    """One streamed leg. Not safe for concurrent readers."""

    __slots__ = (
        "_deadline",
        "_done",
        "_ended",
        "_expired",
        "_first_deadline",
        "_loop",
        "_on_close",
        "_pending",
        "_reader",
        "_relay",
        "_relay_chunked",
        "_span",
        "_src",
        "_timeouts",
        "_timer",
        "_timer_at",
        "_total_deadline",
        "backend",
        "chunks_read",
        "loop",
    )

    def __init__(
        self,
        backend: str,
        source: LegSource,
        timeouts: TimeoutsConfig,
        total_deadline: float,
        on_close: Callable[[], None] | None = None,
        first_deadline: float | None = None,
    ):
        self.backend = backend
        self._src = source
        self._pending = source.events
        self._on_close = on_close
        # Held: get_running_loop() and current_task() without it make a getpid syscall each
        # on this Python (3.11); the pump reads it too.
        self._loop = self.loop = asyncio.get_running_loop()
        self._timeouts = timeouts
        self._total_deadline = total_deadline
        # From when the request was sent (open_stream passes it), not from the headers.
        self._first_deadline = (
            first_deadline if first_deadline is not None else self._loop.time() + timeouts.first_token_s
        )
        self._done = False
        self._ended = False  # the source was released or closed: never touched again
        # The read deadline: one timer per stream, re-armed only when it fires early (an
        # `asyncio.timeout_at` per read cost ~5 us, a fifth of a streamed chunk's CPU).
        self._deadline = (0.0, FIRST_TOKEN_TIMEOUT)  # the current read's, and its kind
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._reader: asyncio.Task[Any] | None = None  # the task waiting for data
        self._expired = False
        self.chunks_read = 0
        self._span: Any = None  # the leg's trace span (router/observability/tracing.py), ended on close
        self._relay: Callable[[deque[bytes]], bool] | None = None
        self._relay_chunked: Callable[[bytes], tuple[int, int]] | None = None

    def relay_from_reads(
        self,
        relay: Callable[[deque[bytes]], bool] | None,
        relay_chunked: Callable[[bytes], tuple[int, int]] | None = None,
    ) -> None:
        """`relay` takes the leg's events as they arrive, in the connection's read callback,
        while the leg's reader waits (sources that can: the hand-written connection): it pops
        the events it relayed and returns True when it took them all; the reader wakes only
        for the rest. A streamed token then costs no task wake-up (~5 us of ~30 a paced
        chunk). None: every event wakes the reader. `relay_chunked` is first offered each
        read of a chunked body, before it is read into events: (the bytes it took of the
        read's start, the events they were)."""
        self._relay, self._relay_chunked = relay, relay_chunked
        self._src.direct = self._direct if relay is not None else None
        self._src.direct_chunked = self._direct_chunked if relay_chunked is not None else None

    def _direct(self, events: deque[bytes]) -> bool:
        relay = self._relay
        if relay is None or self._reader is None or self._done:
            return False
        before = len(events)
        took_all = relay(events)
        if taken := before - len(events):
            self._took(taken)
        return took_all

    def _direct_chunked(self, data: bytes) -> int:
        relay = self._relay_chunked
        if relay is None or self._reader is None or self._done:
            return 0
        taken, events = relay(data)
        if events:
            self._took(events)
        return taken

    def _took(self, events: int) -> None:
        """What the reader would have read: its idle deadline starts again from now."""
        self.chunks_read += events
        deadline = self._loop.time() + self._timeouts.idle_s
        if deadline < self._total_deadline:
            self._deadline = (deadline, IDLE_TIMEOUT)

    async def next_chunk(self) -> dict[str, Any] | None:
        """The next chunk, or None once the engine sent `[DONE]`."""
        while not self._pending:
            if self._done:
                return None
            await self._read_more()
        return self._parse_next()

    async def next_chunks(self) -> list[dict[str, Any]]:
        """Every chunk already received (at least one, waiting for it if need be), or []
        once the engine sent `[DONE]`. A chunk that cannot be read is raised on the call
        after the chunks before it, so none of those is lost."""
        first = await self.next_chunk()
        if first is None:
            return []
        out = [first]
        pending = self._pending
        while pending and pending[0] != b"[DONE]":
            try:
                chunk = self._parse_next(peek=True)
            except UpstreamError:
                break  # left pending: the next call raises it
            pending.popleft()
            if chunk is not None:  # peeked past "[DONE]" never: the loop stops there
                out.append(chunk)
        return out

    async def next_payloads(self) -> list[bytes]:
        """Every event's data already received, unparsed (at least one, waiting for it if need
        be), or [] once the engine sent `[DONE]`."""
        while not self._pending:
            if self._done:
                return []
            await self._read_more()
        return self.ready_payloads()

    def ready_payloads(self) -> list[bytes]:
        """`next_payloads` without waiting: the events already received, maybe none."""
        pending = self._pending
        if not pending:
            return []
        out = list(pending)
        pending.clear()
        if b"[DONE]" in out:  # the last event; anything after it is dropped
            self._done = True
            del out[out.index(b"[DONE]") :]
        self.chunks_read += len(out)
        return out

    @property
    def holds_bytes(self) -> bool:
        """The source holds a first read's body past its leading chunks (`take_held`)."""
        return bool(self._src.held)

    def take_held(self, shape: Callable[[bytes], tuple[bytes, int, int] | None]) -> bytes:
        """The held bytes read now: `shape` takes the plain token chunks they begin with on
        their bytes ((the client's events, the bytes taken, chunks); None: none), the rest
        become events as any read's (`ready_payloads`). What `shape` made of them, or b""."""
        made = b""

        def offer(data: bytes) -> int:
            nonlocal made
            shaped = shape(data)
            if shaped is None:
                return 0
            made, taken, chunks = shaped
            self._took(chunks)
            return taken

        self._src.read_held(offer)
        return made

    @property
    def done(self) -> bool:
        """`[DONE]` was read, or the leg was closed: nothing more will come."""
        return self._done

    def _parse_next(self, peek: bool = False) -> dict[str, Any] | None:
        payload = self._pending[0] if peek else self._pending.popleft()
        if payload == b"[DONE]":
            self._done = True
            self._pending.clear()
            return None
        chunk = self.parse(payload)
        self.chunks_read += 1
        return chunk

    def parse(self, payload: bytes) -> dict[str, Any]:
        """One event's data as a chunk; an engine's error event or an unreadable chunk is an
        `UpstreamError`."""
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise UpstreamError(self.backend, PROTOCOL, f"unparseable chunk {payload[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise UpstreamError(self.backend, PROTOCOL, f"chunk is not an object: {payload[:200]!r}")
        if "error" in chunk and "choices" not in chunk:
            err = chunk["error"]
            msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            raise UpstreamError(self.backend, ENGINE_ERROR, msg, body=chunk)
        return chunk

    async def _read_more(self) -> None:
        now = self._loop.time()
        if self.chunks_read == 0:
            deadline, kind = self._first_deadline, FIRST_TOKEN_TIMEOUT
        else:
            deadline, kind = now + self._timeouts.idle_s, IDLE_TIMEOUT
        if self._total_deadline <= deadline:
            deadline, kind = self._total_deadline, TOTAL_TIMEOUT
        self._deadline = (deadline, kind)
        if self._timer is None or self._timer_at > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self._loop.call_at(deadline, self._on_deadline), deadline
        task = self._reader = asyncio.current_task(self._loop)
        assert task is not None  # called from a task
        cancelling = task.cancelling()
        try:
            await self._src.wait()
        except asyncio.CancelledError:
            # Ours (the deadline passed) unless someone else cancelled the task too.
            if self._expired and task.uncancel() <= cancelling:
                # The deadline's kind as it stands: a relayed event may have moved it on.
                raise UpstreamError(self.backend, self._deadline[1], "no data from the engine in time") from None
            raise
        finally:
            self._reader = None
        if not self._pending:
            failure = self._src.failure
            if failure is not None:
                raise UpstreamError(self.backend, failure[0], failure[1])

    def _on_deadline(self) -> None:
        self._timer = None
        reader = self._reader
        if reader is None or self._done:
            return  # not waiting: the next read arms the timer again
        deadline = self._deadline[0]
        if self._loop.time() < deadline:  # the read's deadline moved on since it was armed
            self._timer, self._timer_at = self._loop.call_at(deadline, self._on_deadline), deadline
            return
        self._expired = True
        reader.cancel()

    def abort(self) -> None:
        """Drop the connection now (the engine aborts the request). Idempotent."""
        self._done = True
        self._relay = None
        if not self._ended:
            self._ended = True
            self._src.close()
        self._closed("aborted")

    def finish(self) -> None:
        """Release after [DONE]: the connection goes back to the pool. Idempotent."""
        self._done = True
        self._relay = None
        if not self._ended:
            self._ended = True
            self._src.release()
        self._closed("done")

    def _closed(self, outcome: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        cb, self._on_close = self._on_close, None
        if cb is not None:
            cb()
        span, self._span = self._span, None
        if span is not None:
            tracing.end_leg(span, outcome)
