"""Upstream calls: one pooled aiohttp session, streamed legs that yield parsed chunks.

Every upstream leg is an `UpstreamStream` (router/engine/stream.py). Deadlines: connect
(aiohttp), first chunk, idle between chunks and total; each failure is an `UpstreamError`
whose `kind` says precisely what happened, so the caller can retry, resume or report it.

TCP_NODELAY: aiohttp's BaseProtocol sets it in `connection_made` for client and server
sockets alike, so streamed chunks are not held back by Nagle's algorithm and delayed ACKs.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from router.config.schema import TimeoutsConfig
from router.engine.errors import (
    BROKEN,
    CONNECT,
    CONNECT_TIMEOUT,
    FIRST_TOKEN_TIMEOUT,
    MAX_ERROR_BODY,
    PROTOCOL,
    TOO_LARGE,
    TOTAL_TIMEOUT,
    AnswerTooLarge,
    UpstreamError,
    status_error,
)
from router.engine.pool import LegPool
from router.engine.stream import AiohttpSource, LegSource, UpstreamStream
from router.observability import tracing

# aiohttp >= 3.10 raises ConnectionTimeoutError for connect/sock_connect; older versions
# its parent ServerTimeoutError (only connect timeouts are configured on the session).
_CONNECT_TIMEOUT_ERRORS = (getattr(aiohttp, "ConnectionTimeoutError", aiohttp.ServerTimeoutError),)


# Bounds on an engine's body read whole (its streams are read chunk by chunk: stream.py).
# A non-streamed answer (the pass-through of a direct strategy, a prefill leg's answer,
# /tokenize, the capability check): 64 MiB is ~30x the JSON of a 32k-token completion
# with 5 top logprobs per token.
MAX_ANSWER_BYTES = 64 * 2**20
# /health, /metrics and /v1/models (vLLM's exposition is ~100 KiB with a few LoRA
# adapters): what a background check reads, for every engine, every few seconds.
MAX_CHECK_BYTES = 4 * 2**20


async def read_bounded(resp: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
    """The whole body of `resp`, or AnswerTooLarge as soon as it passes `limit` bytes
    (declared or received): an endless or huge body costs the router `limit` at most."""
    if resp.content_length is not None and resp.content_length > limit:
        raise AnswerTooLarge(what, limit)
    chunks: list[bytes] = []
    size = 0
    while data := await resp.content.readany():
        size += len(data)
        if size > limit:
            raise AnswerTooLarge(what, limit)
        chunks.append(data)
    return b"".join(chunks)


def _upstream_socket(rcvbuf: int, addr_info: Any) -> socket.socket:
    """An engine connection's socket with a bounded receive buffer (set before connect,
    so the TCP window is sized for it; Linux doubles the value)."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return sock


class UpstreamClient:
    """The router's one HTTP client for all engines (pooled keep-alive connections)."""

    def __init__(self, timeouts: TimeoutsConfig, read_bytes: int = 64 * 1024):
        self.timeouts = timeouts
        # How much of a leg is read at a time, apart from the client side's bound
        # (server.stream_buffer_bytes): aiohttp pauses the socket at twice its read_bufsize,
        # and the kernel receive buffer sets the TCP window. At 8 KiB an answer the engine
        # sends at once took 5-7 reads, each a wake-up, a pause and a resume; at 64 KiB two
        # (bench/RESULTS.md). Under a slow client the router stops reading the leg once
        # about this much is held (the rest waits at the engine).
        self._read_bufsize = max(1024, read_bytes // 2)
        self._rcvbuf = read_bytes
        self._session: aiohttp.ClientSession | None = None
        # Streamed legs to plain http:// engines: a hand-written HTTP/1.1 client
        # (router/engine/http1.py), aiohttp's cost a chunk as much as the rest of its relay.
        self._legs: LegPool | None = None
        self._read_bytes = read_bytes
        # Headers every request to a backend carries, by backend name: a DP rank's
        # X-data-parallel-rank (router/config/data_parallel.py; the registry keeps it).
        self.backend_headers: dict[str, dict[str, str]] = {}

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

    @property
    def legs(self) -> LegPool:
        if self._legs is None:
            self._legs = LegPool(self.timeouts.connect_s, self._rcvbuf, self._read_bytes)
        return self._legs

    async def close(self) -> None:
        if self._legs is not None:
            self._legs.close()
            self._legs = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @staticmethod
    def _headers(api_key: str, trace: dict[str, str] | None = None) -> dict[str, str]:
        # `trace`: the leg's trace context (traceparent, tracestate; router/observability/tracing.py).
        h = {"Content-Type": "application/json", **trace} if trace else {"Content-Type": "application/json"}
        if api_key:
            h["Authorization"] = f"Bearer {api_key}"
        return h

    def _request(
        self, backend: str, body: dict[str, Any], api_key: str, trace: dict[str, str] | None, encoded: bytes | None
    ) -> tuple[dict[str, str], bytes]:
        """A POST's headers (the backend's own included, e.g. a DP rank's) and its body."""
        headers = self._headers(api_key, trace)
        extra = self.backend_headers.get(backend)
        if extra:
            headers.update(extra)
        return headers, orjson.dumps(body) if encoded is None else encoded

    async def _post(
        self,
        backend: str,
        url: str,
        body: dict[str, Any],
        api_key: str,
        deadline: float | None,
        timeout_kind: str = TOTAL_TIMEOUT,
        trace: dict[str, str] | None = None,
        encoded: bytes | None = None,
    ) -> aiohttp.ClientResponse:
        """POST and wait for the response headers until `deadline`; a miss is an
        UpstreamError of kind `timeout_kind` (the deadline's meaning), or CONNECT_TIMEOUT
        when the TCP connection itself took longer than timeouts.connect_s."""
        headers, data = self._request(backend, body, api_key, trace, encoded)
        try:
            if deadline is None:  # bounded by the caller's timer (post_raw): skip a no-op Timeout
                resp = await self.session.post(url, data=data, headers=headers)
            else:
                async with asyncio.timeout_at(deadline):
                    resp = await self.session.post(url, data=data, headers=headers)
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
                raw = await resp.content.read(MAX_ERROR_BODY)
            except (aiohttp.ClientError, ConnectionError):
                raw = b""
            finally:
                resp.release()
            raise status_error(backend, resp.status, raw)
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
        encoded: bytes | None = None,
    ) -> UpstreamStream:
        """Open a streamed leg. `on_close` runs once when the leg is finished or aborted
        (not when opening fails: the caller handles that). `encoded`: `body` already
        serialised (the legs of a race share one copy of a large prompt)."""
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
            source: LegSource
            if base_url.startswith("http://"):
                source = await self._open_leg(
                    backend, base_url, path, body, api_key, head_deadline, kind, trace, encoded
                )
            else:
                resp = await self._post(backend, base_url + path, body, api_key, head_deadline, kind, trace, encoded)
                source = AiohttpSource(resp)
        except BaseException as e:
            tracing.end_leg(leg, "failed", str(e) or type(e).__name__)
            raise
        stream = UpstreamStream(backend, source, self.timeouts, total_deadline, on_close, first_deadline=first_deadline)
        stream._span = leg
        return stream

    async def _open_leg(
        self,
        backend: str,
        base_url: str,
        path: str,
        body: dict[str, Any],
        api_key: str,
        deadline: float,
        timeout_kind: str,
        trace: dict[str, str] | None,
        encoded: bytes | None,
    ) -> LegSource:
        """`_post` of a streamed leg on the hand-written client: the same request, the
        same errors."""
        headers, data = self._request(backend, body, api_key, trace, encoded)
        try:
            return await self.legs.request(backend, base_url, path, headers, data, deadline=deadline)
        except TimeoutError:
            raise UpstreamError(backend, timeout_kind, "no response headers in time") from None

    async def post_raw(
        self,
        backend: str,
        base_url: str,
        path: str,
        body: dict[str, Any],
        *,
        api_key: str = "",
        total_deadline: float | None = None,
        limit: int = MAX_ANSWER_BYTES,
    ) -> bytes:
        """A non-streaming call: the engine's 200 answer as bytes (errors raise; an answer
        past `limit` bytes is an UpstreamError of kind TOO_LARGE)."""
        loop = asyncio.get_running_loop()
        if total_deadline is None:
            total_deadline = loop.time() + self.timeouts.total_s
        leg, trace = tracing.start_leg(tracing.leg_kind(path, body), backend, path)
        try:
            if base_url.startswith("http://"):
                raw = await self._post_whole(backend, base_url, path, body, api_key, total_deadline, trace, limit)
            else:
                raw = await self._post_raw(backend, base_url + path, body, api_key, total_deadline, trace, limit)
        except BaseException as e:
            tracing.end_leg(leg, "failed", str(e) or type(e).__name__)
            raise
        tracing.end_leg(leg, "done")
        return raw

    async def _post_whole(
        self,
        backend: str,
        base_url: str,
        path: str,
        body: dict[str, Any],
        api_key: str,
        total_deadline: float,
        trace: dict[str, str] | None,
        limit: int,
    ) -> bytes:
        """`_post_raw` on the hand-written client (plain http://), as streamed legs are: the
        same request, the same errors. Through aiohttp's client a /tokenize call (one on every
        request of a policy reading the KV index) of a 1,400-token prompt cost ~240 us of
        CPU, here ~140 us."""
        headers, data = self._request(backend, body, api_key, trace, None)
        try:
            async with asyncio.timeout_at(total_deadline):
                conn = await self.legs.request(backend, base_url, path, headers, data, whole=limit)
                try:
                    while not conn.body_done and conn.failure is None and not conn.closed:
                        await conn.wait()
                except BaseException:  # the timer's cancellation included
                    conn.close()
                    raise
        except TimeoutError:
            raise UpstreamError(backend, TOTAL_TIMEOUT, "no complete response in time") from None
        if conn.failure is not None or not conn.body_done or conn.raw is None:
            kind, detail = conn.failure or (BROKEN, "connection closed by the engine")
            conn.close()
            raise UpstreamError(backend, kind, detail)
        raw = bytes(conn.raw)
        conn.release()
        return raw

    async def _post_raw(
        self,
        backend: str,
        url: str,
        body: dict[str, Any],
        api_key: str,
        total_deadline: float,
        trace: dict[str, str] | None,
        limit: int,
    ) -> bytes:
        # One timer for headers and body (each timer is a heap entry on every request).
        try:
            async with asyncio.timeout_at(total_deadline):
                resp = await self._post(backend, url, body, api_key, None, trace=trace)
                try:
                    raw = await read_bounded(resp, limit, "the answer")
                    resp.release()
                    return raw
                except AnswerTooLarge as e:
                    resp.close()
                    raise UpstreamError(backend, TOO_LARGE, str(e)) from None
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
        limit: int = MAX_ANSWER_BYTES,
    ) -> dict[str, Any]:
        raw = await self.post_raw(
            backend, base_url, path, body, api_key=api_key, total_deadline=total_deadline, limit=limit
        )
        try:
            out = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(backend, PROTOCOL, f"unparseable response {raw[:200]!r}") from None
        if not isinstance(out, dict):
            raise UpstreamError(backend, PROTOCOL, "response is not a JSON object")
        return out

    async def get_text(
        self, url: str, timeout_s: float, api_key: str = "", limit: int = MAX_CHECK_BYTES
    ) -> tuple[int, str]:
        """A check's GET: (status, body); AnswerTooLarge past `limit` bytes."""
        async with asyncio.timeout(timeout_s):
            async with self.session.get(url, headers=self._headers(api_key)) as resp:
                raw = await read_bounded(resp, limit, f"GET {url}")
                return resp.status, raw.decode(resp.charset or "utf-8", "replace")
