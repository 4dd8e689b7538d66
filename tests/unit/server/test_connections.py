"""Request heads held to a time and a size limit (router/server/connections.py), on a real
aiohttp server with the router's runner and raw client sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from router.server.connections import HeadLimits, LimitedAppRunner
from support.polling import eventually

HEAD_TIMEOUT_S = 0.5
MAX_HEAD = 16 * 1024


class Served:
    def __init__(self, port: int, dropped: list[int]) -> None:
        self.port = port
        self.dropped = dropped

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"{len(await request.read())} bytes")

    app = web.Application()
    app.router.add_route("*", "/", hello)
    dropped: list[int] = []
    limits = HeadLimits(HEAD_TIMEOUT_S, MAX_HEAD, on_dropped=lambda: dropped.append(1))
    runner = LimitedAppRunner(app, limits=limits, keepalive_timeout=30)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Served(port, dropped)
    finally:
        await runner.cleanup()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of the answer the server sends before it closes the connection
    (read to EOF: a connection left open fails the liveness bound)."""
    async with asyncio.timeout(10):
        raw = await reader.read()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), orjson.loads(body)


async def test_a_head_that_stalls_gets_408_and_the_connection_is_closed(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the blank line
    status, body = await _answer(reader)
    assert status == 408
    assert "server.header_timeout_s = 0.5 s" in body["error"]["message"]
    writer.close()


async def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout(served: Served) -> None:
    reader, writer = await served.connect()
    status, _ = await _answer(reader)
    assert status == 408
    writer.close()


async def test_a_head_dribbled_past_the_timeout_is_cut_although_bytes_keep_coming(served: Served) -> None:
    """A byte at a time keeps no head alive: the clock runs from its first byte."""
    reader, writer = await served.connect()
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")

    async def dribble() -> None:
        for _ in range(100):
            writer.write(b"a")
            await asyncio.sleep(HEAD_TIMEOUT_S / 5)  # a slow client: the behaviour under test

    task = asyncio.create_task(dribble())
    try:
        status, _ = await _answer(reader)
    finally:
        task.cancel()
    assert status == 408
    writer.close()


async def test_a_head_over_the_size_limit_gets_431_and_the_connection_is_closed(served: Served) -> None:
    reader, writer = await served.connect()
    field = b"X-Big-%d: " + b"a" * 4000 + b"\r\n"  # each field within aiohttp's own 8190 bytes
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(field % i for i in range(8)))
    status, body = await _answer(reader)
    assert status == 431
    assert f"server.max_header_bytes = {MAX_HEAD}" in body["error"]["message"]
    writer.close()
    await eventually(lambda: served.dropped == [1], 5, "the dropped head reported for a heap trim")


async def test_requests_within_the_limits_are_served_on_one_connection(served: Served) -> None:
    """Heads just under the limit, a body that takes longer than the head timeout, and
    keep-alive between requests: none of it is cut."""
    reader, writer = await served.connect()
    big = b"X-Big: " + b"a" * 8000 + b"\r\n"
    for _ in range(3):
        body = b"x" * 100
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n" + big + b"\r\n" + body[:50])
        await asyncio.sleep(HEAD_TIMEOUT_S * 1.5)  # the body's time is not the head's
        writer.write(body[50:])
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            assert await reader.readexactly(length) == b"100 bytes"
        await asyncio.sleep(HEAD_TIMEOUT_S * 1.5)  # idle between requests: keep-alive's, not the head's
    writer.close()
    assert served.dropped == []


async def test_a_later_head_that_stalls_is_cut_at_its_own_deadline(served: Served) -> None:
    """The head timer outlives the head it was armed for: a head that begins on the same
    connection shortly before that timer fires is not cut then, but at its own deadline."""
    reader, writer = await served.connect()
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    await asyncio.sleep(HEAD_TIMEOUT_S * 0.6)  # the next head begins before the first head's timer fires
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the blank line
    status, body = await _answer(reader)
    assert status == 408
    assert "server.header_timeout_s" in body["error"]["message"]
    writer.close()
