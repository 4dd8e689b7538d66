"""Keep-alive connections for streamed engine legs over plain http:// (router/engine/http1.py).

One pool for all engines, idle connections kept by (host, port). A request goes out on the
most recently used idle connection; one that the engine closed while it sat idle fails
before any byte of a response, and the request is sent again once on a fresh connection
(as aiohttp does). Idle connections expire after `keepalive_s`; names are resolved with
the loop's getaddrinfo and cached for `dns_ttl_s` (aiohttp's TCPConnector settings).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from aiohttp.http import SERVER_SOFTWARE

from router.engine.errors import CONNECT, CONNECT_TIMEOUT, MAX_ERROR_BODY, UpstreamError, status_error
from router.engine.http1 import LegConnection

# Requests with a body up to this size go out in one write with their head (a copy of the
# body, cheaper than a second send); larger ones as two writes.
_JOIN_BODY_BYTES = 64 * 1024
T = TypeVar("T")


class BadHeader(ValueError):
    """A request header value that would end the header line early."""


def request_head(target: str, host: str, headers: dict[str, str], length: int) -> bytes:
    # Accept and User-Agent as aiohttp sends them (no Accept-Encoding: bodies are relayed
    # as they come, never decompressed).
    parts = [
        f"POST {target} HTTP/1.1\r\nHost: {host}\r\nAccept: */*\r\nUser-Agent: {SERVER_SOFTWARE}\r\n"
        f"Content-Length: {length}\r\n"
    ]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise BadHeader(f"header {name!r} has a line break")
        parts.append(f"{name}: {value}\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("utf-8")


class Origin:
    """Where a base URL's requests go: the socket address and the Host header."""

    __slots__ = ("host", "host_header", "ip", "port", "prefix")

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname or parts.username or parts.password:
            raise ValueError(f"not a plain http:// origin: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        try:
            self.ip: int = ipaddress.ip_address(self.host).version
        except ValueError:
            self.ip = 0
        # As aiohttp writes it: the port only when it is not the default one.
        name = f"[{self.host}]" if self.ip == 6 else self.host
        self.host_header = name if self.port == 80 else f"{name}:{self.port}"
        self.prefix = parts.path


async def _head(waiter: asyncio.Future[None], deadline: float | None) -> None:
    """The response head's wait, failed with TimeoutError at `deadline`: one timer handle on
    the waiter (an `asyncio.timeout` around it cost ~14 us of a request's CPU; this is the
    wait every leg makes, the rarer ones below keep it)."""
    if deadline is None:
        await waiter
        return
    timer = waiter.get_loop().call_at(deadline, _expire, waiter)
    try:
        await waiter
    finally:
        timer.cancel()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


async def _within(aw: Awaitable[T], deadline: float | None) -> T:
    if deadline is None:
        return await aw
    async with asyncio.timeout_at(deadline):
        return await aw


class LegPool:
    """Connections for streamed legs, by (host, port)."""

    def __init__(
        self, connect_s: float, rcvbuf: int, read_limit: int, keepalive_s: float = 30.0, dns_ttl_s: float = 300.0
    ):
        self.connect_s = connect_s
        self.rcvbuf = rcvbuf
        self.read_limit = read_limit
        self.keepalive_s = keepalive_s
        self.dns_ttl_s = dns_ttl_s
        self._idle: dict[tuple[str, int], list[LegConnection]] = {}
        self._draining: dict[LegConnection, float] = {}  # finished, reading to the body's end
        self._all: set[LegConnection] = set()
        self._dns: dict[tuple[str, int], tuple[float, list[Any]]] = {}
        self._origins: dict[str, Origin] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    def origin(self, base_url: str) -> Origin:
        o = self._origins.get(base_url)
        if o is None:
            o = self._origins[base_url] = Origin(base_url)
        return o

    async def request(
        self,
        backend: str,
        base_url: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        whole: int = 0,
        deadline: float | None = None,
    ) -> LegConnection:
        """POST `body`; the connection once the response head arrived with status 200
        (`whole` > 0: its body is read whole, up to that many bytes: `LegConnection.send`).
        Another status is an UpstreamError of kind STATUS with the answer's body (bounded);
        no connection, CONNECT or CONNECT_TIMEOUT. Past `deadline` (loop time), TimeoutError.
        Cancelling closes the connection."""
        origin = self.origin(base_url)
        head = request_head(origin.prefix + path, origin.host_header, headers, len(body))
        request = head + body if len(body) <= _JOIN_BODY_BYTES else None
        key = (origin.host, origin.port)
        for attempt in (0, 1):
            conn, reused = await self._acquire(backend, origin, key, deadline)
            error: UpstreamError | None = None
            try:
                if request is not None:
                    conn.send(request, whole)
                else:
                    conn.send(head, whole)
                    assert conn.transport is not None
                    conn.transport.write(body)
                waiter = conn.head_waiter
                if waiter is not None:
                    await _head(waiter, deadline)
                if conn.status and conn.status != 200:
                    error = await _within(self._status_error(backend, conn), deadline)  # released or closed it
            except BaseException:
                conn.close()
                raise
            if conn.status == 200:
                return conn
            if error is not None:
                raise error
            conn.close()
            if reused and not conn.got_bytes and attempt == 0:
                continue  # the engine closed it while it sat idle: a fresh one
            detail = conn.failure[1] if conn.failure else "no response"
            raise UpstreamError(backend, CONNECT, f"request to {base_url}{path} failed: {detail}")
        raise AssertionError("unreachable")

    @staticmethod
    async def _status_error(backend: str, conn: LegConnection) -> UpstreamError:
        raw = conn.raw if conn.raw is not None else bytearray()
        while not conn.body_done and not conn.closed and len(raw) < MAX_ERROR_BODY:
            await conn.wait()
        body = bytes(raw[:MAX_ERROR_BODY])
        status = conn.status
        if conn.body_done:
            conn.release()
        else:
            conn.close()
        return status_error(backend, status, body)

    async def _acquire(
        self, backend: str, origin: Origin, key: tuple[str, int], deadline: float | None
    ) -> tuple[LegConnection, bool]:
        idle = self._idle.get(key)
        if idle:
            now = asyncio.get_running_loop().time()
            while idle:
                conn = idle.pop()
                if conn.closed or now - conn.idle_since > self.keepalive_s:
                    conn.close()
                    continue
                return conn, True
        return await _within(self._connect(backend, origin, key), deadline), False

    async def _connect(self, backend: str, origin: Origin, key: tuple[str, int]) -> LegConnection:
        loop = asyncio.get_running_loop()
        where = f"{origin.host}:{origin.port}"
        try:
            addresses = await self._addresses(origin)
        except OSError as e:
            raise UpstreamError(backend, CONNECT, f"cannot connect to {where}: {e}") from None
        error: OSError | None = None
        for family, type_, proto, _, address in addresses:
            sock = socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                # Set before connect, so the TCP window is sized for it (Linux doubles it).
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                async with asyncio.timeout(self.connect_s):
                    await loop.sock_connect(sock, address)
                _, conn = await loop.create_connection(lambda: LegConnection(self, key, self.read_limit), sock=sock)
            except TimeoutError:
                sock.close()
                raise UpstreamError(
                    backend, CONNECT_TIMEOUT, f"no connection to {where} within {self.connect_s:g} s"
                ) from None
            except OSError as e:
                sock.close()
                error = e
                continue
            except BaseException:
                sock.close()
                raise
            self._all.add(conn)
            return conn
        raise UpstreamError(backend, CONNECT, f"cannot connect to {where}: {error}")

    async def _addresses(self, origin: Origin) -> list[Any]:
        if origin.ip:
            family = socket.AF_INET6 if origin.ip == 6 else socket.AF_INET
            return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (origin.host, origin.port))]
        loop = asyncio.get_running_loop()
        key = (origin.host, origin.port)
        hit = self._dns.get(key)
        if hit is not None and hit[0] > loop.time():
            return hit[1]
        infos = await loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM, flags=socket.AI_ADDRCONFIG)
        self._dns[key] = (loop.time() + self.dns_ttl_s, infos)
        return infos

    # -- called by the connections --

    def release(self, conn: LegConnection) -> None:
        self._draining.pop(conn, None)
        conn.idle_since = conn.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        self._sweep_later()

    def draining(self, conn: LegConnection) -> None:
        self._draining[conn] = conn.loop.time()
        self._sweep_later()

    def forget(self, conn: LegConnection) -> None:
        self._all.discard(conn)
        self._draining.pop(conn, None)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def _sweep_later(self) -> None:
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self.keepalive_s / 2, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle (or draining) for longer than keepalive_s."""
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        stale = [c for c, t in self._draining.items() if now - t > self.keepalive_s]
        for idle in self._idle.values():
            stale += [c for c in idle if now - c.idle_since > self.keepalive_s]
        for conn in stale:
            conn.close()
        if self._draining or any(self._idle.values()):
            self._sweep_later()

    def close(self) -> None:
        """Close every connection (the router is stopping)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        self._draining.clear()
