"""A hand-written HTTP/1.1 client connection for streamed engine legs (plain http://).

aiohttp's client costs a streamed chunk its parser's callbacks, a StreamReader (feed_data,
readany, its pause/resume bookkeeping) and the waiters around them: reading a leg through
it took 1.2-2.4x the CPU of this client (16- and 256-chunk streams, docs/BENCHMARKS.md),
10-25% of the router's CPU per streamed request. Here the protocol de-chunks the body in
`data_received` and feeds the SSE decoder directly; the leg's reader is woken by one
future, only when it is waiting, and not at all for events its `direct` callback relays
there (plain token chunks go to the client from this callback); an answer read at once is
read to its first chunks and the rest held for the same relay (`HOLD_BYTES`). One response
at a time, no pipelining.

The response head is parsed strictly (router/engine/response_head.py); the body is
chunked, Content-Length or read to close. A connection goes back to its pool
(router/engine/pool.py) only once its body was read whole and the engine did not ask to
close it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.engine.chunked import ChunkedBody, ChunkError, leading_chunks
from router.engine.errors import BROKEN, MAX_ERROR_BODY, PROTOCOL, TOO_LARGE, AnswerTooLarge
from router.engine.response_head import CHUNKED, LENGTH, MAX_HEAD_BYTES, TO_CLOSE, HeadError, body_framing, parse_head
from router.engine.sse import SSEDecoder, SSEError

if TYPE_CHECKING:
    from router.engine.pool import LegPool


# Connection states.
_IDLE, _HEAD, _BODY, _DONE = 0, 1, 2, 3
# A streamed answer's first read past this many body bytes (an answer read at once, ~32
# token chunks and more) is read up to its first chunks only (a chat answer's first is its
# role, the first token the second); the rest is held until the reader asks (`read_held`,
# `wait`), by when the answer's first token is out and its plain token chunks can be
# relayed on their bytes in one split instead of de-chunking, SSE framing and the relay's
# three passes. The steps it adds cost more than that saves below ~25 chunks (`bench
# stream-instructions`: +4% of a 16-chunk request's instructions, -11% at 64, -26% at 256).
HOLD_BYTES = 8192
LEADING_CHUNKS = 2


class LegConnection(asyncio.Protocol):
    """One keep-alive connection to an engine; one response at a time."""

    def __init__(self, pool: LegPool, key: tuple[str, int], read_limit: int):
        self.pool = pool
        self.key = key
        self.read_limit = read_limit
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.state = _IDLE
        self._head = bytearray()
        self.head_waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.framing = TO_CLOSE
        self._left = 0  # LENGTH: body bytes to come
        self._chunks = ChunkedBody()  # CHUNKED: the body's state between reads
        self.got_bytes = False  # any byte of the response yet
        self.body_done = False
        # The SSE events of a 200 answer (the leg's reader takes them), or the bytes of an
        # error answer (`raw`, up to MAX_ERROR_BODY) or of a whole answer (`whole` > 0).
        self.whole = 0
        self.events: deque[bytes] = deque()
        self.decoder = SSEDecoder()
        self.raw: bytearray | None = None
        self.failure: tuple[str, str] | None = None  # (error kind, detail) once it broke
        self.waiter: asyncio.Future[None] | None = None
        self.unread = 0
        self.paused = False
        self.discard = False  # finished before the body's end: read to its end, then pooled
        # Takes events as they arrive while the reader waits (router/engine/stream.py,
        # `UpstreamStream.relay_from_reads`): pops what it relayed, True when it took all.
        self.direct: Callable[[deque[bytes]], bool] | None = None
        # Offered each read of a chunked body first, while the reader waits and nothing read
        # before is left: takes the read's leading whole chunks on their bytes (plain token
        # chunks: de-chunked, framed and relayed by one split); the bytes it took.
        self.direct_chunked: Callable[[bytes], int] | None = None
        # The first read's body past its leading chunks, not yet read (`HOLD_BYTES`).
        self.held = b""

    # -- the request --

    def send(self, request: bytes, whole: int = 0) -> None:
        """Write a request and expect its response. `whole` > 0: a 200 answer is kept whole
        in `raw` (a non-streamed answer), up to that many bytes (past it: TOO_LARGE)."""
        assert self.transport is not None
        self.whole = whole
        self.state = _HEAD
        self.got_bytes = self.body_done = self.discard = False
        self.failure = self.raw = self.direct = self.direct_chunked = None
        self.held = b""
        self.status = 0
        self._head.clear()
        self.head_waiter = self.loop.create_future()
        self.transport.write(request)

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.state == _BODY:
            if self.held:  # not asked for in time: read before this read, as usual
                data, self.held = self.held + data, b""
            self._body(data)
        elif self.state == _HEAD:
            self.got_bytes = True
            self._head_data(data)
        else:  # bytes nobody asked for: the connection cannot be trusted with another request
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.held and self.state == _BODY:  # what came before the close is read first
            held, self.held = self.held, b""
            self._body(held)
        self.closed = True
        self.pool.forget(self)
        if self.state == _BODY and not self.body_done:
            if self.framing == TO_CLOSE and exc is None:
                self._end_of_body()
            else:
                self._fail(BROKEN, f"connection lost: {exc!r}" if exc else "connection closed by the engine")
        elif self.state == _HEAD:
            self._fail(BROKEN, "connection closed before a response")
        self._wake()
        self._wake_head()

    # -- the response --

    def _head_data(self, data: bytes) -> None:
        buf = self._head
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    self._fail(PROTOCOL, "response head too large")
                    self.close()
                return
            try:
                status, _, headers, http11 = parse_head(bytes(buf[:end]))
                if 100 <= status < 200:  # an interim answer: the real one follows
                    del buf[: end + 4]
                    continue
                self.framing, self._left, self.keep_alive = body_framing(status, headers, http11)
            except HeadError as e:
                self._fail(PROTOCOL, str(e))
                self.close()
                return
            break
        rest = bytes(buf[end + 4 :])
        buf.clear()
        self.status, self.headers = status, headers
        self.state = _BODY
        self._chunks = ChunkedBody()
        self.events = deque()
        self.decoder = SSEDecoder()
        self.unread = 0
        if status != 200 or self.whole:
            self.raw = bytearray()
            if status == 200 and self.framing == LENGTH and self._left > self.whole:
                self._too_large()
                return
        if self.framing == LENGTH and self._left == 0:
            if rest:  # bytes past the answer: no second response was asked for
                self.keep_alive = False
            self._end_of_body()
        elif rest:
            if self.framing == CHUNKED and self.raw is None and len(rest) >= HOLD_BYTES:
                payloads, cut = leading_chunks(rest, LEADING_CHUNKS)
                if 0 < cut < len(rest):
                    # Whole chunks: the body's state stays between chunks, as reading them would leave it.
                    self.held = rest[cut:]
                    self._deliver(b"".join(payloads))
                    self._wake_head()
                    return
            self._body(rest)
        self._wake_head()

    def _body(self, data: bytes) -> None:
        framing = self.framing
        if framing == CHUNKED:
            if self.direct_chunked is not None and not self.discard:
                data = self._offer_chunked(data)
            self._chunked_body(data)
            return
        if framing == LENGTH:
            n = len(data)
            if n >= self._left:
                if n > self._left:  # bytes past the answer: no second response was asked for
                    self.keep_alive = False
                data = data[: self._left]
                self._left = 0
                self.body_done = True
            else:
                self._left -= n
        if data:
            self._deliver(data)
        if self.body_done:
            self._end_of_body()

    def _chunked_body(self, data: bytes) -> None:
        chunks = self._chunks
        try:
            data = chunks.feed(data)
        except ChunkError as e:
            self._fail(PROTOCOL, str(e))
            self.close()
            return
        if chunks.done:
            self.body_done = True
            if chunks.past_end:  # no second response was asked for
                self.keep_alive = False
        if data:
            self._deliver(data)
        if self.body_done:
            self._end_of_body()

    def _offer_chunked(self, data: bytes) -> bytes:
        """`direct_chunked` offered the read (after the chunk it began inside, read the
        usual way), when the reader waits and every event read before was taken; the rest."""
        chunks = self._chunks
        if not chunks.between_chunks:
            left = chunks.inside_chunk
            if not left or left >= len(data):
                return data
            self._chunked_body(data[:left])
            if self.failure is not None:
                return b""  # the read broke the grammar: nothing after it is read
            data = data[left:]
        waiter, direct = self.waiter, self.direct_chunked
        if direct is None or waiter is None or waiter.done() or not self._all_taken():
            return data
        taken = direct(data)
        return data[taken:] if taken else data

    def _all_taken(self) -> bool:
        """A read may be offered on its bytes: not past events the reader has yet to take,
        nor an event the decoder carries over (nor an answer kept whole or an error's body)."""
        return not self.events and self.raw is None and self.decoder.idle

    def read_held(self, offer: Callable[[bytes], int]) -> None:
        """The held bytes (`HOLD_BYTES`) read now: `offer` takes what it can of their start on
        their bytes (the bytes it took; only when every event read before was taken and none
        is carried over), the rest is read as any read; the reader is not woken."""
        data, self.held = self.held, b""
        if not data or self.closed:
            return
        if self._all_taken() and self._chunks.between_chunks and self.failure is None:
            data = data[offer(data) :]
        if data:
            self._body(data)

    def _deliver(self, data: bytes) -> None:
        if self.discard:
            return
        raw = self.raw
        if raw is not None:
            if self.whole and self.status == 200:
                if len(raw) + len(data) > self.whole:
                    self._too_large()
                    return
                raw += data
            elif len(raw) < MAX_ERROR_BODY:
                raw += data[: MAX_ERROR_BODY - len(raw)]
            self._wake()
            return
        try:
            events = self.decoder.feed(data)
        except SSEError as e:
            self._fail(PROTOCOL, str(e))
            self.close()
            return
        if events:
            pending = self.events
            pending.extend(events)
            direct = self.direct
            waiter = self.waiter
            if direct is not None and waiter is not None and not waiter.done() and direct(pending):
                return  # relayed from here: the reader sleeps on, no task wake-up a chunk
            self.unread += len(data)
            if self.unread > self.read_limit and not self.paused and self.transport is not None:
                # A slow reader: the engine waits (TCP window) until the reader catches up.
                self.paused = True
                self.transport.pause_reading()
            self._wake()

    def _end_of_body(self) -> None:
        self.body_done = True
        self.state = _DONE
        if self.raw is None and not self.discard:
            self._fail(BROKEN, "stream ended without [DONE]")  # read only if no [DONE] came
        if self.discard:
            self.release()
        self._wake()

    def _too_large(self) -> None:
        self._fail(TOO_LARGE, str(AnswerTooLarge("the answer", self.whole)))
        self.close()
        self._wake()
        self._wake_head()

    def _fail(self, kind: str, detail: str) -> None:
        if self.failure is None:
            self.failure = (kind, detail)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _wake_head(self) -> None:
        waiter = self.head_waiter
        if waiter is not None:
            self.head_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the leg's reader --

    def wait(self) -> asyncio.Future[None]:
        """Resolved when more events arrived or the body ended (everything received so far
        was taken: reading resumes if it was paused)."""
        self.unread = 0
        if self.paused:
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()
        waiter = self.waiter = self.loop.create_future()
        if self.held:  # read as a read that came now: `direct_chunked` offered it first
            held, self.held = self.held, b""
            self._body(held)
        if not waiter.done() and (self.failure is not None or self.body_done or self.closed):
            waiter.set_result(None)
        return waiter

    def release(self) -> None:
        """The leg is done with the connection: back to the pool if its body was read whole
        and may be followed by another request; read to the body's end first if not yet."""
        self.events = deque()
        self.raw = self.direct = self.direct_chunked = None
        held, self.held = self.held, b""
        if self.closed:
            return
        if not self.keep_alive or (self.failure is not None and not self.body_done):
            self.close()
            return
        if self.paused:
            # Paused by a read past `read_limit` (the body's end may have come in that same
            # read): a pooled connection left paused never hears its next answer.
            self.paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        if not self.body_done:
            self.discard = True  # e.g. the last chunk's terminator has not arrived yet
            if held:
                self._body(held)  # its end there: pooled (`_end_of_body`); bad: closed
            if not self.body_done and not self.closed:
                self.pool.draining(self)
        else:
            self.state = _IDLE
            self.failure = None
            self.pool.release(self)

    def close(self) -> None:
        """Close the connection (an engine aborts the request it was answering)."""
        self.direct = self.direct_chunked = None
        self.held = b""
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self.pool.forget(self)
