"""Streaming answers to the client (router/server/respond.py), on a real aiohttp server: an
end of answer held whole goes out whole, and the connection stays bounded after it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import ClientSession, HttpVersion10, web

from router.server.respond import SSEWriter
from support.polling import eventually
from support.ports import serve_on_free_port

BUFFER = 8 * 1024


def _sndbuf(request: web.Request) -> int:
    assert request.transport is not None
    sock = request.transport.get_extra_info("socket")
    return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, list[int]]]:
    sizes: list[int] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        writer = SSEWriter(request, "r1", buffer_bytes=BUFFER)
        await writer.send([{"i": -1}])
        sizes.append(_sndbuf(request))
        resp = await writer.finish([{"i": i, "text": "x" * 200} for i in range(int(request.query["n"]))])
        sizes.append(_sndbuf(request))
        return resp

    app = web.Application()
    app.router.add_get("/", answer)
    runner, url = await serve_on_free_port(app)
    try:
        yield url + "/", sizes
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("n", [2, 300])
async def test_an_end_held_whole_arrives_whole_and_the_connection_stays_bounded(
    served: tuple[str, list[int]], n: int
) -> None:
    url, sizes = served
    async with ClientSession() as session:
        for _ in range(2):  # the second request on the same (keep-alive) connection
            async with session.get(url, params={"n": str(n)}) as resp:
                body = await resp.read()
            events = body.split(b"\n\n")
            assert events[-2:] == [b"data: [DONE]", b""]
            assert len(events) == n + 3
    # Bounded before and after each end of answer, the large ones included.
    assert len(sizes) == 4
    assert len(set(sizes)) == 1


@pytest.fixture
async def written_now() -> AsyncIterator[tuple[str, list[bool]]]:
    """A server answering with `send_raw` (?now=0) or with `write_now` where `ready()` says
    it can (?now=1); `readiness` records what `ready()` said before and after the first write."""
    readiness: list[bool] = []
    events = [b"data: %d\n\n" % i for i in range(5)]

    async def answer(request: web.Request) -> web.StreamResponse:
        writer = SSEWriter(request, "r1", buffer_bytes=BUFFER)
        readiness.append(writer.ready())  # nothing sent yet: the headers go with the first write
        await writer.send_raw(events[0])
        readiness.append(writer.ready())
        for e in events[1:]:
            if request.query["now"] == "1" and writer.ready():
                writer.write_now(e)
            else:
                await writer.send_raw(e)
        return await writer.finish()

    app = web.Application()
    app.router.add_get("/", answer)
    runner, url = await serve_on_free_port(app)
    try:
        yield url + "/", readiness
    finally:
        await runner.cleanup()


async def test_events_written_now_frame_the_body_as_aiohttp_does(written_now: tuple[str, list[bool]]) -> None:
    url, readiness = written_now
    bodies = []
    async with ClientSession() as session:
        for now in ("0", "1"):
            async with session.get(url, params={"now": now}) as resp:
                assert resp.headers["Transfer-Encoding"] == "chunked"
                bodies.append(await resp.read())
    assert bodies[0] == bodies[1] == b"".join(b"data: %d\n\n" % i for i in range(5)) + b"data: [DONE]\n\n"
    assert readiness == [False, True, False, True]


async def test_an_http_1_0_client_s_stream_ends_with_the_connection(written_now: tuple[str, list[bool]]) -> None:
    """HTTP/1.0 has no chunked body: the stream's end is the connection's, keep-alive asked
    for or not (aiohttp would keep it open and the client wait for more)."""
    url, readiness = written_now
    async with ClientSession(version=HttpVersion10) as session, session.get(url, params={"now": "1"}) as resp:
        body = await asyncio.wait_for(resp.read(), 30)
    assert body == b"".join(b"data: %d\n\n" % i for i in range(5)) + b"data: [DONE]\n\n"
    assert readiness == [False, False]  # not chunked: aiohttp writes it, never `write_now`


@pytest.fixture
async def unread() -> AsyncIterator[tuple[int, list[str]]]:
    """A server whose answer is one held end of `?n=` events of 200 bytes, to a client
    that reads nothing; `outcomes` says how each `finish` ended."""
    outcomes: list[str] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        writer = SSEWriter(request, "r1", buffer_bytes=BUFFER, idle_s=0.5)
        # The answer's start, then more than every buffer holds, queued without a wait:
        # what finish writes stays behind it in the process.
        await writer.send_raw(b"data: start\n\n")
        assert writer.ready()
        writer.write_now(b"data: " + b"x" * 4 * 1024 * 1024 + b"\n\n")
        try:
            resp = await writer.finish([{"i": i, "text": "x" * 200} for i in range(int(request.query["n"]))])
        except ConnectionResetError as e:
            outcomes.append(type(e).__name__)
            raise
        outcomes.append("finished")
        return resp

    app = web.Application()
    app.router.add_get("/", answer)
    runner, url = await serve_on_free_port(app)
    try:
        yield int(url.rsplit(":", 1)[1]), outcomes
    finally:
        await runner.cleanup()


async def test_an_end_of_answer_to_a_client_that_reads_nothing_is_bounded(unread: tuple[int, list[str]]) -> None:
    # A client that reads nothing: the answer's start already fills every buffer, so the
    # end (2 events, or 300: more than the buffer's limit) waits behind it, bounded by
    # idle_s; the client is dropped, the end is not written without a timer.
    port, outcomes = unread

    def settled(k: int) -> Callable[[], bool]:
        return lambda: len(outcomes) == k

    for k, n in enumerate((2, 300), start=1):
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /?n=%d HTTP/1.1\r\nHost: x\r\n\r\n" % n)
        await eventually(settled(k), 10, f"the end of {n} events settled")
        writer.close()
    assert outcomes == ["ClientStalled", "ClientStalled"]
