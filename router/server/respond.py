"""Writing answers to the client: JSON bodies, OpenAI-shaped errors, and streaming answers.

Headers go out with the first chunk, not before: until then a failure can still be an
HTTP error status with a JSON body. After that, an error travels as vLLM sends it, an
error event followed by `data: [DONE]`.

Bounded buffering: a client that reads slower than the engine writes makes `send` wait
once `server.stream_buffer_bytes` are queued for it (the socket's send buffer is bounded
to the same size), and while `send` waits the router does not read that stream's engine
leg, so the engine's socket carries the backpressure. A client that accepts nothing for
`timeouts.idle_s` (or past the request's total deadline) is dropped: `ClientStalled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import weakref
from collections.abc import Awaitable
from typing import Any, Protocol

import orjson
from aiohttp import HttpVersion11, web
from aiohttp.http import StreamWriter

from router.engine.sse import DONE_EVENT, format_event
from router.errors import RouterError, sse_error_event


def json_response(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers)


def error_response(err: RouterError) -> web.Response:
    return web.Response(
        body=err.body_bytes(), status=err.status, content_type="application/json", headers=err.headers or None
    )


def close_if_unframed(request: web.Request, resp: web.StreamResponse) -> None:
    """Before `prepare`: a body of unknown length to an HTTP/1.0 client ends with the
    connection (HTTP/1.0 has no chunked body). aiohttp keeps a connection the client asked
    to keep alive, and the client would wait for more."""
    if request.version < HttpVersion11 and resp.content_length is None:
        resp.force_close()


class EventFraming(Protocol):
    """How a stream's chunks are written for an API other than OpenAI's (vLLM's
    `data: <json>` events and `data: [DONE]`), e.g. Anthropic's named events
    (router/answer/messages_answer.py)."""

    def encode(self, chunks: list[dict[str, Any]]) -> bytes: ...

    def trailer(self) -> bytes: ...

    def error(self, err: RouterError) -> bytes: ...


# Client connections whose write buffers are already bounded (by stream_buffer_bytes,
# one figure per process).
_BOUNDED: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()

# The most an answer's end widens the kernel's send queue to (Linux doubles it).
_WIDEST = 1024 * 1024
# Bytes a write adds to its data besides the header lines: the chunk framing, the body's
# last-chunk marker and, on an answer's first write, the status line and the head's end.
_FRAMING_BYTES = 128


class ClientStalled(ConnectionResetError):
    """The client read nothing of its stream for too long; its connection was dropped."""


class _EventStreamResponse(web.StreamResponse):
    # Headers go out in the same write as the first events (aiohttp's own Response does
    # this; a StreamResponse sends them alone from prepare()): one syscall less a request.
    _send_headers_immediately = False


class SSEWriter:
    def __init__(
        self,
        request: web.Request,
        request_id: str,
        *,
        buffer_bytes: int = 8 * 1024,
        idle_s: float = 60.0,
        deadline: float | None = None,
        framing: EventFraming | None = None,
    ):
        self.request = request
        self._framing = framing
        self.request_id = request_id
        self.response: web.StreamResponse | None = None
        self._buffer_bytes = buffer_bytes
        self._idle_s = idle_s
        self._deadline = deadline  # loop time
        self._held = b""  # the answer's last events, written by finish()
        self._chunked = False  # the body has begun, chunked by aiohttp: `write_now` may frame more

    @property
    def started(self) -> bool:
        """Something of the answer was sent (or is held to be sent with its end)."""
        return self.response is not None or bool(self._held)

    async def _start(self) -> web.StreamResponse:
        resp = _EventStreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Request-Id": self.request_id,
            },
        )
        transport = self.request.transport
        if transport is not None and transport not in _BOUNDED:
            # Once per connection (keep-alive requests share it; the socket lookup and the
            # setsockopt were two syscalls a request). Past `high` queued bytes the
            # protocol pauses and writer.drain() waits.
            with contextlib.suppress(TypeError):  # uvloop's TLS transport takes no weak
                _BOUNDED.add(transport)  # reference: bounded again on each request
            transport.set_write_buffer_limits(high=self._buffer_bytes, low=self._buffer_bytes // 2)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                # The kernel's queue too (Linux doubles the value): autotuned, a socket
                # nobody reads can hold megabytes.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._buffer_bytes)
        close_if_unframed(self.request, resp)
        await resp.prepare(self.request)
        self.response = resp
        return resp

    async def send(self, chunks: list[dict[str, Any]]) -> None:
        if not chunks:
            return
        if self._framing is not None:
            await self.send_raw(self._framing.encode(chunks))
            return
        await self.send_raw(format_event(chunks[0]) if len(chunks) == 1 else b"".join(map(format_event, chunks)))

    async def send_raw(self, data: bytes, last: bool = False) -> None:
        """Events already encoded (SSE, or the API's own framing), in one transport write.
        `last`: the answer's last events, nothing to wait for after them: held and written
        by `finish` (or `fail`) with the end of the body, one write (each costs a send)."""
        if not data:
            return
        if self._held:
            data, self._held = self._held + data, b""
        if last:
            self._held = data
            return
        resp = self.response or await self._start()
        # drain=False: aiohttp would wait for a paused socket without a timeout; the wait
        # below has one, and a timer is armed only when there is something to wait for.
        writer = self.request.writer
        await writer.write(data, drain=False)  # type: ignore[call-arg]  # StreamWriter's own keyword
        if not self._chunked:
            # The headers are out with these bytes; from now on `write_now` may frame the body's
            # chunks itself (HTTP/1.1 chunked, no compression: what aiohttp writes for this response).
            self._chunked = isinstance(writer, StreamWriter) and writer.chunked and not resp.compression
        transport = self.request.transport
        if transport is not None and transport.get_write_buffer_size() > self._buffer_bytes:
            await self._bounded(self.request.writer.drain())

    def ready(self) -> bool:
        """`write_now` can write at once: the body has started, nothing is held for the end,
        and the client's buffer has room (else `send_raw` waits for it, bounded)."""
        if not self._chunked or self._held:
            return False
        transport = self.request.transport
        return (
            transport is not None
            and not transport.is_closing()
            and (transport.get_write_buffer_size() <= self._buffer_bytes)
        )

    def write_now(self, data: bytes) -> None:
        """Events written from a callback (no await), after `ready()`: one body chunk, framed
        as aiohttp's StreamWriter frames it and counted in its figures. Hand-written because
        its `write` is a coroutine (a callback cannot await one)."""
        writer = self.request.writer
        frame = b"%x\r\n%b\r\n" % (len(data), data)
        writer.buffer_size += len(frame)
        writer.output_size += len(frame)
        transport = self.request.transport
        assert transport is not None  # `ready()` said so
        transport.write(frame)

    async def _bounded(self, aw: Awaitable[None]) -> None:
        """Await a write that waits for the client, for at most timeouts.idle_s (and not
        past the total deadline); then drop the connection: `ClientStalled`."""
        wait = self._idle_s
        if self._deadline is not None:
            wait = min(wait, self._deadline - asyncio.get_running_loop().time())
        try:
            async with asyncio.timeout(max(0.0, wait)):
                await aw
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()  # close() would wait for the unread bytes to leave
            raise ClientStalled(
                f"the client read nothing of its stream for {wait:.3g} s (timeouts.idle_s or total_s)"
            ) from None

    async def finish(self, chunks: list[dict[str, Any]] | None = None) -> web.StreamResponse:
        """The last `chunks`, [DONE] and the end of the body, in one write."""
        resp = self.response or await self._start()
        if self._framing is not None:
            last = (self._framing.encode(chunks) if chunks else b"") + self._framing.trailer()
        else:
            last = b"".join(map(format_event, chunks)) + DONE_EVENT if chunks else DONE_EVENT
        if self._held:
            last, self._held = self._held + last, b""
        sock = self._widened(len(last))
        try:
            if sock is None and self._cannot_wait(len(last)):
                await resp.write_eof(last)  # no timer armed for a write that cannot wait
            else:
                await self._bounded(resp.write_eof(last))
        finally:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._buffer_bytes)
        return resp

    def _cannot_wait(self, size: int) -> bool:
        """A write of `size` bytes (with their framing, and the response head if aiohttp
        still holds it back) that aiohttp's drain cannot wait on: nothing queued for the
        client, so its protocol is not paused, and the bytes fit under the buffer's limit,
        so they cannot pause it."""
        transport, resp = self.request.transport, self.response
        if transport is None or resp is None or transport.get_write_buffer_size():
            return False
        head = sum(len(k) + len(v) + 4 for k, v in resp.headers.items())  # "k: v\r\n"
        return size + head + _FRAMING_BYTES <= self._buffer_bytes

    def _widened(self, size: int) -> socket.socket | None:
        """An end of answer larger than the client's send buffer, already held whole by
        the router: the kernel's queue widened to take it in one send, narrowed again
        after it (a keep-alive connection's next stream is bounded as before). Measured:
        an instant 60 KB answer went out in ~5 sends, each an EAGAIN and an epoll wait
        (two setsockopt calls cost less than one of those rounds)."""
        if size <= self._buffer_bytes:
            return None
        transport = self.request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None:
            return None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, min(size, _WIDEST))
        except OSError:
            return None
        return sock  # type: ignore[no-any-return]

    async def fail(self, err: RouterError) -> web.StreamResponse:
        """Only after the stream started: an error event, then [DONE]."""
        event = sse_error_event(err) + DONE_EVENT if self._framing is None else self._framing.error(err)
        if self._held:
            event, self._held = self._held + event, b""
        if self.response is None:
            await self._start()
        assert self.response is not None
        await self._bounded(self.response.write(event))
        await self._bounded(self.response.write_eof())
        return self.response
