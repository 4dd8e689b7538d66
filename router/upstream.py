"""Upstream calls: one pooled aiohttp session, streamed legs that yield parsed chunks.

Every upstream leg is an `UpstreamStream`: `next_chunk()` returns the next parsed SSE
chunk (a dict) or None after `[DONE]`, and `abort()` drops the connection at once, which
is how vLLM (and the simulator) learn that the client went away and abort the request.
Deadlines: connect (aiohttp), first chunk, idle between chunks and total; each failure is
an `UpstreamError` whose `kind` says precisely what happened, so the caller can retry,
resume or report it.

TCP_NODELAY: aiohttp's BaseProtocol sets it in `connection_made` for client and server
sockets alike (tests/router/test_upstream_nodelay.py checks), so streamed chunks are not
held back by Nagle's algorithm and delayed ACKs.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from collections import deque
from typing import Any, Callable

import aiohttp
import orjson

from .config import TimeoutsConfig
from .sse import SSEDecoder, SSEError
from . import tracing

# Failure kinds, in the words a client error message uses.
CONNECT = "connect"  # could not connect / connection refused
CONNECT_TIMEOUT = "connect_timeout"  # no TCP connection within timeouts.connect_s
STATUS = "status"  # the engine answered an HTTP error status
FIRST_TOKEN_TIMEOUT = "first_token_timeout"
IDLE_TIMEOUT = "idle_timeout"
TOTAL_TIMEOUT = "total_timeout"
BROKEN = "broken"  # the stream ended without [DONE] or the connection dropped
ENGINE_ERROR = "engine_error"  # the engine sent an error event mid-stream
PROTOCOL = "protocol"  # unparseable chunk

_MAX_ERROR_BODY = 64 * 1024
# aiohttp >= 3.10 raises ConnectionTimeoutError for connect/sock_connect; older versions
# its parent ServerTimeoutError (only connect timeouts are configured on the session).
_CONNECT_TIMEOUT_ERRORS = (getattr(aiohttp, "ConnectionTimeoutError", aiohttp.ServerTimeoutError),)


class UpstreamError(Exception):
    def __init__(self, backend: str, kind: str, detail: str, *, status: int | None = None, body: Any = None):
        super().__init__(f"backend {backend}: {kind}: {detail}")
        self.backend = backend
        self.kind = kind
        self.detail = detail
        self.status = status
        self.body = body  # STATUS: the engine's raw answer (bytes); ENGINE_ERROR: the event

    @property
    def client_fault(self) -> bool:
        """The engine refused the request itself (4xx): no other engine would accept it."""
        return (
            self.kind == STATUS
            and self.status is not None
            and 400 <= self.status < 500
            and self.status not in (408, 429)
        )

    @property
    def backend_fault(self) -> bool:
        """Counts against the backend's health (breaker, retries)."""
        return not self.client_fault


class UpstreamStream:
    """One streamed leg. Not safe for concurrent readers."""

    __slots__ = (
        "backend",
        "_resp",
        "_decoder",
        "_pending",
        "_loop",
        "_timeouts",
        "_total_deadline",
        "_first_deadline",
        "_done",
        "_on_close",
        "chunks_read",
        "_span",
    )

    def __init__(
        self,
        backend: str,
        resp: aiohttp.ClientResponse,
        timeouts: TimeoutsConfig,
        total_deadline: float,
        on_close: Callable[[], None] | None = None,
        first_deadline: float | None = None,
    ):
        self.backend = backend
        self._resp = resp
        self._decoder = SSEDecoder()
        self._pending: deque[bytes] = deque()
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()
        self._timeouts = timeouts
        self._total_deadline = total_deadline
        # From when the request was sent (open_stream passes it), not from the headers.
        self._first_deadline = (
            first_deadline if first_deadline is not None else self._loop.time() + timeouts.first_token_s
        )
        self._done = False
        self.chunks_read = 0
        self._span = None  # the leg's trace span (router/tracing.py), ended on close

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

    def _parse_next(self, peek: bool = False) -> dict[str, Any] | None:
        payload = self._pending[0] if peek else self._pending.popleft()
        if payload == b"[DONE]":
            self._done = True
            self._pending.clear()
            return None
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
        self.chunks_read += 1
        return chunk

    async def _read_more(self) -> None:
        now = self._loop.time()
        if self.chunks_read == 0:
            deadline, kind = self._first_deadline, FIRST_TOKEN_TIMEOUT
        else:
            deadline, kind = now + self._timeouts.idle_s, IDLE_TIMEOUT
        if self._total_deadline <= deadline:
            deadline, kind = self._total_deadline, TOTAL_TIMEOUT
        try:
            async with asyncio.timeout_at(deadline):
                data = await self._resp.content.readany()
        except TimeoutError:
            raise UpstreamError(self.backend, kind, "no data from the engine in time") from None
        except (aiohttp.ClientError, ConnectionError) as e:
            raise UpstreamError(self.backend, BROKEN, f"connection lost: {e!r}") from None
        if not data:
            # EOF before [DONE] (which would have been consumed first): a broken leg.
            raise UpstreamError(self.backend, BROKEN, "stream ended without [DONE]")
        try:
            self._pending.extend(self._decoder.feed(data))
        except SSEError as e:
            raise UpstreamError(self.backend, PROTOCOL, str(e)) from None

    def abort(self) -> None:
        """Drop the connection now (the engine aborts the request). Idempotent."""
        self._done = True
        self._resp.close()
        self._closed("aborted")

    def finish(self) -> None:
        """Release after [DONE]: the connection goes back to the pool. Idempotent."""
        self._done = True
        self._resp.release()
        self._closed("done")

    def _closed(self, outcome: str) -> None:
        cb, self._on_close = self._on_close, None
        if cb is not None:
            cb()
        span, self._span = self._span, None
        if span is not None:
            tracing.end_leg(span, outcome)


def _upstream_socket(rcvbuf: int, addr_info: Any) -> socket.socket:
    """An engine connection's socket with a bounded receive buffer (set before connect,
    so the TCP window is sized for it; Linux doubles the value)."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return sock


class UpstreamClient:
    """The router's one HTTP client for all engines (pooled keep-alive connections)."""

    def __init__(self, timeouts: TimeoutsConfig, read_buffer_bytes: int = 8 * 1024):
        self.timeouts = timeouts
        # How much of a leg aiohttp buffers before it stops reading the engine's socket
        # (it pauses at twice its read_bufsize), and the socket's kernel receive buffer:
        # with a slow client the router stops reading the leg, and these bound what piles
        # up meanwhile (the rest waits at the engine).
        self._read_bufsize = max(1024, read_buffer_bytes // 2)
        self._rcvbuf = read_buffer_bytes
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0,
                limit_per_host=0,
                ttl_dns_cache=300,
                keepalive_timeout=30,
                socket_factory=functools.partial(_upstream_socket, self._rcvbuf),
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                read_bufsize=self._read_bufsize,
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self.timeouts.connect_s, sock_connect=self.timeouts.connect_s
                ),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @staticmethod
    def _headers(api_key: str, trace: dict[str, str] | None = None) -> dict[str, str]:
        # `trace`: the leg's trace context (traceparent, tracestate; router/tracing.py).
        h = {"Content-Type": "application/json", **trace} if trace else {"Content-Type": "application/json"}
        if api_key:
            h["Authorization"] = f"Bearer {api_key}"
        return h

    async def _post(
        self,
        backend: str,
        url: str,
        body: dict[str, Any],
        api_key: str,
        deadline: float | None,
        timeout_kind: str = TOTAL_TIMEOUT,
        trace: dict[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        """POST and wait for the response headers until `deadline`; a miss is an
        UpstreamError of kind `timeout_kind` (the deadline's meaning), or CONNECT_TIMEOUT
        when the TCP connection itself took longer than timeouts.connect_s."""
        try:
            if deadline is None:  # bounded by the caller's timer (post_raw): skip a no-op Timeout
                resp = await self.session.post(url, data=orjson.dumps(body), headers=self._headers(api_key, trace))
            else:
                async with asyncio.timeout_at(deadline):
                    resp = await self.session.post(url, data=orjson.dumps(body), headers=self._headers(api_key, trace))
        except _CONNECT_TIMEOUT_ERRORS as e:  # before TimeoutError: it is a subclass
            raise UpstreamError(
                backend, CONNECT_TIMEOUT, f"no connection to {url} within {self.timeouts.connect_s:g} s: {e}"
            ) from None
        except TimeoutError:
            raise UpstreamError(backend, timeout_kind, "no response headers in time") from None
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError) as e:
            raise UpstreamError(backend, CONNECT, f"cannot connect to {url}: {e}") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(backend, CONNECT, f"request to {url} failed: {e!r}") from None
        if resp.status != 200:
            try:
                raw = await resp.content.read(_MAX_ERROR_BODY)
            except (aiohttp.ClientError, ConnectionError):
                raw = b""
            finally:
                resp.release()
            raise UpstreamError(
                backend,
                STATUS,
                f"HTTP {resp.status}: {raw[:300].decode('utf-8', 'replace')}",
                status=resp.status,
                body=raw,
            )
        return resp

    async def open_stream(
        self,
        backend: str,
        base_url: str,
        path: str,
        body: dict[str, Any],
        *,
        api_key: str = "",
        total_deadline: float | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> UpstreamStream:
        """Open a streamed leg. `on_close` runs once when the leg is finished or aborted
        (not when opening fails: the caller handles that)."""
        loop = asyncio.get_running_loop()
        if total_deadline is None:
            total_deadline = loop.time() + self.timeouts.total_s
        # The first-token deadline runs from now: headers and first chunk share it.
        first_deadline = loop.time() + self.timeouts.first_token_s
        if first_deadline < total_deadline:
            head_deadline, kind = first_deadline, FIRST_TOKEN_TIMEOUT
        else:
            head_deadline, kind = total_deadline, TOTAL_TIMEOUT
        leg, trace = tracing.start_leg(tracing.leg_kind(path, body), backend, path)
        try:
            resp = await self._post(backend, base_url + path, body, api_key, head_deadline, kind, trace)
        except BaseException as e:
            tracing.end_leg(leg, "failed", str(e) or type(e).__name__)
            raise
        stream = UpstreamStream(backend, resp, self.timeouts, total_deadline, on_close, first_deadline=first_deadline)
        stream._span = leg
        return stream

    async def post_raw(
        self,
        backend: str,
        base_url: str,
        path: str,
        body: dict[str, Any],
        *,
        api_key: str = "",
        total_deadline: float | None = None,
    ) -> bytes:
        """A non-streaming call: the engine's 200 answer as bytes (errors raise)."""
        loop = asyncio.get_running_loop()
        if total_deadline is None:
            total_deadline = loop.time() + self.timeouts.total_s
        leg, trace = tracing.start_leg(tracing.leg_kind(path, body), backend, path)
        try:
            raw = await self._post_raw(backend, base_url + path, body, api_key, total_deadline, trace)
        except BaseException as e:
            tracing.end_leg(leg, "failed", str(e) or type(e).__name__)
            raise
        tracing.end_leg(leg, "done")
        return raw

    async def _post_raw(
        self,
        backend: str,
        url: str,
        body: dict[str, Any],
        api_key: str,
        total_deadline: float,
        trace: dict[str, str] | None,
    ) -> bytes:
        # One timer for headers and body (each timer is a heap entry on every request).
        try:
            async with asyncio.timeout_at(total_deadline):
                resp = await self._post(backend, url, body, api_key, None, trace=trace)
                try:
                    return await resp.read()
                except (aiohttp.ClientError, ConnectionError) as e:
                    resp.close()
                    raise UpstreamError(backend, BROKEN, f"connection lost: {e!r}") from None
                except BaseException:  # the timer's cancellation included
                    resp.close()
                    raise
        except TimeoutError:
            raise UpstreamError(backend, TOTAL_TIMEOUT, "no complete response in time") from None

    async def post_json(
        self,
        backend: str,
        base_url: str,
        path: str,
        body: dict[str, Any],
        *,
        api_key: str = "",
        total_deadline: float | None = None,
    ) -> dict[str, Any]:
        raw = await self.post_raw(backend, base_url, path, body, api_key=api_key, total_deadline=total_deadline)
        try:
            out = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(backend, PROTOCOL, f"unparseable response {raw[:200]!r}") from None
        if not isinstance(out, dict):
            raise UpstreamError(backend, PROTOCOL, "response is not a JSON object")
        return out

    async def get_text(self, url: str, timeout_s: float, api_key: str = "") -> tuple[int, str]:
        async with asyncio.timeout(timeout_s):
            async with self.session.get(url, headers=self._headers(api_key)) as resp:
                return resp.status, await resp.text()
