"""Client connections held to a time and a size limit for each request head.

aiohttp bounds each header line and field (8190 bytes) and the number of headers (128),
and closes an idle keep-alive connection after its keep-alive timeout; nothing bounds how
long a request head may take nor how large it is in total (128 fields of 8190 bytes: about
1 MB a connection, kept for as long as the client trickles it). Here, per connection:

- the head (request line and headers) must arrive within `server.header_timeout_s`,
  counted from the connection's start or from the first byte after the previous request's
  body; past it: 408 and the connection is closed (nginx's client_header_timeout, Envoy's
  request_headers_timeout);
- it may be at most `server.max_header_bytes` long; past it: 431 and the connection is
  closed (nginx's large_client_header_buffers, 4 x 8 KiB);
- a connection that ends with a large head partly received asks for the heap to be given
  back once the router is idle (router/server/memtrim.py): no request ran, so nothing else
  would.

The hooks are aiohttp's request handler's own `data_received` and `connection_lost`,
wrapped; the runner builds its server as `web.AppRunner` does and only changes the class of
the connections' handler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from router.config.schema import ServerConfig
from router.errors import RouterError

# A connection dropped with at least this much of a head received asks for a heap trim.
TRIM_AFTER_HEAD_BYTES = 8 * 1024


@dataclass(frozen=True)
class HeadLimits:
    timeout_s: float
    max_bytes: int
    # Called when a connection closes with a large head partly received (heap to trim).
    on_dropped: Callable[[], None] = lambda: None

    @classmethod
    def of(cls, server: ServerConfig, on_dropped: Callable[[], None] = lambda: None) -> HeadLimits:
        return cls(server.header_timeout_s, server.max_header_bytes, on_dropped)


def refusal(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer (OpenAI error body) that closes the connection."""
    body = RouterError(status, message).body_bytes()
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def head_timeout_answer(limits: HeadLimits) -> bytes:
    return refusal(
        408,
        "Request Timeout",
        f"The request head (request line and headers) did not arrive within "
        f"server.header_timeout_s = {limits.timeout_s:g} s.",
    )


def head_too_large_answer(limits: HeadLimits) -> bytes:
    return refusal(
        431,
        "Request Header Fields Too Large",
        f"The request head (request line and headers) is larger than server.max_header_bytes = {limits.max_bytes}.",
    )


class HeadLimitedHandler(RequestHandler):
    """aiohttp's connection handler with the head's time and size limits.

    The head's timer is armed when a head starts and left running when it completes:
    arming and cancelling one for each request of a keep-alive connection cost a few
    microseconds a request. When it fires with no head in progress it ends; with a head
    that started later, it waits for that head's own deadline."""

    __slots__ = ("_body", "_head_bytes", "_head_started", "_head_timer", "_limits")

    _limits: HeadLimits

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started: float | None = None  # loop time the head in progress began
        self._body: Any = None  # the last request's payload: its end starts the next head
        super().connection_made(transport)
        self._head_begins()

    def data_received(self, data: bytes) -> None:
        # Between requests these are head bytes (aiohttp also calls this with b"" to
        # re-parse what it buffered: no bytes, no clock).
        if data and (self._body is None or self._body.is_eof()):
            if self._head_started is None:
                self._head_begins()
            self._head_bytes += len(data)
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a head is complete
            self._head_started = None
            self._head_bytes = 0
            self._body = self._messages[-1][1] if self._messages else None
        elif self._head_bytes > self._limits.max_bytes:
            self._refuse(head_too_large_answer(self._limits))

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        dropped = self._head_bytes >= TRIM_AFTER_HEAD_BYTES
        self._head_bytes = 0
        self._body = None
        super().connection_lost(exc)
        if dropped:
            self._limits.on_dropped()

    def _head_begins(self) -> None:
        self._head_started = self._loop.time()
        if self._head_timer is None:
            self._head_timer = self._loop.call_at(self._head_started + self._limits.timeout_s, self._timed_out)

    def _disarm(self) -> None:
        self._head_started = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _timed_out(self) -> None:
        self._head_timer = None
        started = self._head_started
        if started is None:  # no head in progress: the next one arms the timer again
            return
        now = self._loop.time()
        if self._request_in_progress or now < started + self._limits.timeout_s:
            # A pipelined head during an answer (its turn comes later), or a head that
            # began after the one the timer was armed for: its own deadline.
            due = started + self._limits.timeout_s
            self._head_timer = self._loop.call_at(due if due > now else now + self._limits.timeout_s, self._timed_out)
            return
        self._refuse(head_timeout_answer(self._limits))

    def _refuse(self, answer: bytes) -> None:
        self._disarm()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(answer)  # sent before the close (the transport flushes first)
        self.force_close()


class _HeadLimitedServer(web.Server):
    """aiohttp's server making `HeadLimitedHandler`s."""

    head_limits: HeadLimits

    def __call__(self) -> RequestHandler:
        handler = HeadLimitedHandler(self, loop=self._loop, **self._kwargs)
        handler._limits = self.head_limits
        return handler


class LimitedAppRunner(web.AppRunner):
    """`web.AppRunner` whose connections are held to `limits` (the other keyword
    arguments are AppRunner's, `keepalive_timeout` and the header line limits included)."""

    def __init__(self, app: web.Application, *, limits: HeadLimits, **kwargs: Any):
        super().__init__(app, **kwargs)
        self._head_limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _HeadLimitedServer  # the same server; only its handlers change
        assert isinstance(server, _HeadLimitedServer)
        server.head_limits = self._head_limits
        return server
