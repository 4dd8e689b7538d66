"""Streaming answers to the client (router/server/respond.py), on a real aiohttp server: an
end of answer held whole goes out whole, and the connection stays bounded after it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, HttpVersion10, web

from router.server.respond import SSEWriter
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
