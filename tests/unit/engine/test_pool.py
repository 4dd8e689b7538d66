"""Streamed legs on the hand-written client against a local server writing exact bytes:
the request the engine sees, each body framing, error answers, connection reuse, an idle
connection the engine closed, flow control under a slow reader, abort."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from router.config.schema import TimeoutsConfig
from router.engine.client import UpstreamClient
from router.engine.errors import (
    BROKEN,
    CONNECT,
    CONNECT_TIMEOUT,
    FIRST_TOKEN_TIMEOUT,
    MAX_ERROR_BODY,
    STATUS,
    UpstreamError,
)
from router.engine.pool import BadHeader, LegPool, Origin, request_head
from router.engine.stream import UpstreamStream
from support.polling import eventually
from support.raw_server import Answer, RawServer, chunk, writes

EVENTS = b'data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n'


CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


async def read_all(stream: UpstreamStream) -> list[int]:
    got = []
    while (c := await stream.next_chunk()) is not None:
        got.append(c["n"])
    stream.finish()
    return got


async def test_the_request_carries_the_same_headers_as_before(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    server = await serve(writes(CHUNKED, chunk(EVENTS), b"0\r\n\r\n"))
    client.backend_headers["b"] = {"X-data-parallel-rank": "3"}
    stream = await client.open_stream("b", server.url, "/v1/completions", {"p": 1}, api_key="k")
    assert await read_all(stream) == [1, 2]
    head, body = server.requests[0].split(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/completions HTTP/1.1"
    headers = dict(line.split(b": ", 1) for line in lines[1:])
    assert headers[b"Host"] == server.url.removeprefix("http://").encode()
    assert headers[b"Content-Type"] == b"application/json"
    assert headers[b"Content-Length"] == b"%d" % len(body)
    assert body == b'{"p":1}'
    assert headers[b"Authorization"] == b"Bearer k"
    assert headers[b"X-data-parallel-rank"] == b"3"
    assert headers[b"User-Agent"].startswith(b"Python/")  # as aiohttp writes it


async def test_each_body_framing_reads_to_done_and_reuses_what_it_can(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    answers = [
        [CHUNKED, chunk(EVENTS[:20]), chunk(EVENTS[20:]), b"0\r\n\r\n"],
        [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(EVENTS), EVENTS],
        [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(EVENTS), EVENTS],
    ]

    async def answer(request: bytes, w: asyncio.StreamWriter) -> bool:
        for p in answers[len(server.requests) - 1]:
            w.write(p)
        await w.drain()
        return True

    server = await serve(answer)
    for _ in answers:
        stream = await client.open_stream("b", server.url, "/v1/completions", {})
        assert await read_all(stream) == [1, 2]
    assert server.connections == 1  # the first two shared one; the third asked to close it
    await eventually(lambda: server.eofs == 1)


async def test_a_body_read_to_close(serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient) -> None:
    server = await serve(writes(b"HTTP/1.1 200 OK\r\n\r\n", EVENTS[:10], EVENTS[10:], keep=False))
    stream = await client.open_stream("b", server.url, "/v1/completions", {})
    assert await read_all(stream) == [1, 2]


async def test_a_body_closed_before_done_is_a_broken_leg(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    server = await serve(writes(CHUNKED, chunk(b'data: {"n":1}\n\n'), keep=False))
    stream = await client.open_stream("b", server.url, "/v1/completions", {})
    assert (await stream.next_chunk()) == {"n": 1}
    with pytest.raises(UpstreamError) as e:
        await stream.next_chunk()
    assert e.value.kind == BROKEN
    stream.abort()


async def test_an_error_status_is_a_status_error_with_its_body(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    big = b"x" * (MAX_ERROR_BODY + 10)
    answers = [
        b'HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\n{"error":"x"}',
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n" % len(big) + big,
    ]

    async def answer(request: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(answers[len(server.requests) - 1])
        await w.drain()
        return True

    server = await serve(answer)
    with pytest.raises(UpstreamError) as e:
        await client.open_stream("b", server.url, "/v1/completions", {})
    assert (e.value.kind, e.value.status, e.value.body) == (STATUS, 400, b'{"error":"x"}')
    assert e.value.client_fault
    with pytest.raises(UpstreamError) as e:
        await client.open_stream("b", server.url, "/v1/completions", {})
    assert (e.value.kind, e.value.status, len(e.value.body)) == (STATUS, 503, MAX_ERROR_BODY)
    assert server.connections == 1  # the 400's body was read whole: its connection reused


async def test_an_idle_connection_the_engine_closed_is_replaced(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    answer = writes(CHUNKED, chunk(EVENTS), b"0\r\n\r\n")
    server = await serve(answer)
    assert await read_all(await client.open_stream("b", server.url, "/v1/completions", {})) == [1, 2]
    server.writers[0].close()  # the engine's keep-alive timeout
    assert await read_all(await client.open_stream("b", server.url, "/v1/completions", {})) == [1, 2]
    assert server.connections == 2


async def test_a_reused_connection_closed_before_answering_is_retried_once(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    async def answer(request: bytes, w: asyncio.StreamWriter) -> bool:
        if len(server.requests) == 2:
            return False  # closes without a byte: the race with a keep-alive timeout
        w.write(CHUNKED + chunk(EVENTS) + b"0\r\n\r\n")
        await w.drain()
        return True

    server = await serve(answer)
    for _ in range(2):
        assert await read_all(await client.open_stream("b", server.url, "/v1/completions", {})) == [1, 2]
    assert len(server.requests) == 3
    assert server.connections == 2


async def test_a_fresh_connection_closed_before_answering_is_a_connect_error(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    server = await serve(writes(keep=False))
    with pytest.raises(UpstreamError) as e:
        await client.open_stream("b", server.url, "/v1/completions", {})
    assert e.value.kind == CONNECT
    assert len(server.requests) == 1


async def test_a_head_that_does_not_come_by_the_deadline_is_a_timeout_and_its_connection_closed(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    server = await serve(writes())  # reads the request, answers nothing, keeps the connection
    client = UpstreamClient(TimeoutsConfig(first_token_s=0.2))
    try:
        with pytest.raises(UpstreamError) as e:
            await client.open_stream("b", server.url, "/v1/completions", {})
        assert e.value.kind == FIRST_TOKEN_TIMEOUT
        await eventually(lambda: server.eofs == 1, 5, "the engine sees the connection closed")
        # The pool's own deadline: TimeoutError, for the caller to name.
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await client.legs.request("b", server.url, "/", {}, b"", deadline=loop.time() + 0.05)
    finally:
        await client.close()


async def test_a_refused_connection_is_a_connect_error(client: UpstreamClient) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(UpstreamError) as e:
        await client.open_stream("b", f"http://127.0.0.1:{port}", "/v1/completions", {})
    assert e.value.kind == CONNECT


async def test_a_connect_past_its_timeout_is_a_connect_timeout() -> None:
    pool = LegPool(connect_s=0.0, rcvbuf=65536, read_limit=65536)
    with pytest.raises(UpstreamError) as e:
        await pool.request("b", "http://10.255.255.1:9", "/", {}, b"")
    assert e.value.kind == CONNECT_TIMEOUT
    pool.close()


async def test_a_slow_reader_stops_reading_the_engine_until_it_catches_up(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    event = b'data: {"n":0, "pad":"' + b"x" * 1000 + b'"}\n\n'
    many = 2000
    server = await serve(writes(CHUNKED, *[chunk(event)] * many, chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"))
    client = UpstreamClient(TimeoutsConfig(), read_bytes=16 * 1024)
    try:
        stream = await client.open_stream("b", server.url, "/v1/completions", {})
        conn = stream._src
        await eventually(lambda: getattr(conn, "paused", False))
        assert len(stream._pending) * len(event) < 512 * 1024  # held back: not the 2 MB sent
        n = 0
        while await stream.next_chunk() is not None:
            n += 1
        assert n == many
        stream.finish()
    finally:
        await client.close()


async def test_abort_closes_the_connection(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    sent = asyncio.Event()

    async def answer(request: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(CHUNKED + chunk(b'data: {"n":1}\n\n'))
        await w.drain()
        sent.set()
        return True  # the stream stays open: only the client ends it

    server = await serve(answer)
    stream = await client.open_stream("b", server.url, "/v1/completions", {})
    assert await stream.next_chunk() == {"n": 1}
    stream.abort()
    await eventually(lambda: server.eofs == 1)


async def test_close_closes_the_idle_connections(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    server = await serve(writes(CHUNKED, chunk(EVENTS), b"0\r\n\r\n"))
    assert await read_all(await client.open_stream("b", server.url, "/v1/completions", {})) == [1, 2]
    await client.close()
    await eventually(lambda: server.eofs == 1)


async def test_idle_connections_expire(serve: Callable[[Answer], Awaitable[RawServer]]) -> None:
    server = await serve(writes(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    pool = LegPool(connect_s=5.0, rcvbuf=65536, read_limit=65536, keepalive_s=0.05)
    try:
        conn = await pool.request("b", server.url, "/", {}, b"")
        conn.release()
        await eventually(lambda: server.eofs == 1)
    finally:
        pool.close()


def test_an_origin_is_read_as_aiohttp_writes_it() -> None:
    o = Origin("http://Engine.local:8000/prefix")
    assert (o.host, o.port, o.host_header, o.prefix, o.ip) == ("engine.local", 8000, "engine.local:8000", "/prefix", 0)
    assert Origin("http://10.0.0.1").host_header == "10.0.0.1"
    assert Origin("http://[::1]:81").host_header == "[::1]:81"
    for bad in ("https://h", "http://u:p@h"):
        with pytest.raises(ValueError, match="not a plain http"):
            Origin(bad)


def test_a_header_with_a_line_break_is_refused() -> None:
    with pytest.raises(BadHeader):
        request_head("/", "h", {"X": "a\r\nInjected: 1"}, 0)


async def test_a_host_name_is_resolved_once_and_cached(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    server = await serve(writes(CHUNKED, chunk(EVENTS), b"0\r\n\r\n", keep=False))
    url = server.url.replace("127.0.0.1", "localhost")
    for _ in range(2):
        assert await read_all(await client.open_stream("b", url, "/v1/completions", {})) == [1, 2]
    assert list(client.legs._dns) == [("localhost", int(url.rsplit(":", 1)[1]))]
    assert server.requests[0].split(b"\r\n")[1] == b"Host: " + url.removeprefix("http://").encode()
