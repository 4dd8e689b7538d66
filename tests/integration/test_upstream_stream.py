"""UpstreamStream against a real aiohttp server: reading chunks one by one or all that
arrived, and where an unreadable event lands."""

from __future__ import annotations

import asyncio
import functools
import operator
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
from aiohttp import web

from router.config.schema import TimeoutsConfig
from router.engine.client import UpstreamClient
from router.engine.errors import ENGINE_ERROR, IDLE_TIMEOUT, PROTOCOL, UpstreamError
from router.engine.stream import UpstreamStream
from support.polling import eventually
from support.ports import site_port
from support.raw_server import RawServer, chunk, writes


def event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


# `await serve_sse(*writes)`: the URL of a server answering every POST with those bytes.
ServeSse = Callable[..., Awaitable[str]]


@pytest.fixture
async def serve_sse() -> AsyncIterator[ServeSse]:
    runners: list[web.AppRunner] = []

    async def start(*writes: bytes) -> str:
        async def handler(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for w in writes:
                await resp.write(w)
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site_port(site)}"

    yield start
    for r in runners:
        await r.cleanup()


async def open_leg(url: str) -> tuple[UpstreamClient, UpstreamStream]:
    client = UpstreamClient(TimeoutsConfig())
    stream = await client.open_stream("b", url.rstrip("/"), "/v1/completions", {})
    return client, stream


async def test_next_chunks_returns_everything_received_in_one_read(serve_sse: ServeSse) -> None:
    url = await serve_sse(
        event(b'{"n":1}') + event(b'{"n":2}') + event(b'{"n":3}'), event(b'{"n":4}') + event(b"[DONE]")
    )
    client, stream = await open_leg(url)
    try:
        got = []
        while chunks := await stream.next_chunks():
            assert chunks  # never an empty batch before the end
            got.append([c["n"] for c in chunks])
        assert functools.reduce(operator.iadd, got, []) == [1, 2, 3, 4]
        assert len(got[0]) >= 3  # at least the first write, read at once
        assert await stream.next_chunks() == []
        stream.finish()
    finally:
        await client.close()


async def test_an_answer_written_at_once_past_the_held_bound_is_read_whole_in_order() -> None:
    # Its first read holds the head and every chunk: read to its first chunks, the rest when
    # the reader asks (router/engine/http1.py); the connection is reused after it.
    payloads = [b'{"n":%d,"text":"%s"}' % (i, b"w" * 80) for i in range(200)]
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer += b"".join(chunk(event(p)) for p in [*payloads, b"[DONE]"]) + b"0\r\n\r\n"
    server = RawServer(writes(answer))
    await server.start()
    client = UpstreamClient(TimeoutsConfig())
    try:
        for _ in range(2):
            stream = await client.open_stream("b", server.url, "/v1/completions", {})
            got = []
            while batch := await stream.next_payloads():
                got += batch
            assert got == payloads
            stream.finish()
        assert server.connections == 1
    finally:
        await client.close()
        await server.stop()


@pytest.mark.parametrize(
    ("bad", "kind"),
    [
        (b"{not json", PROTOCOL),
        (b"[1, 2]", PROTOCOL),
        (b'{"error": {"message": "Internal server error", "code": 500}}', ENGINE_ERROR),
    ],
)
async def test_a_bad_event_comes_after_the_good_ones_before_it(serve_sse: ServeSse, bad: bytes, kind: str) -> None:
    url = await serve_sse(event(b'{"n":1}') + event(b'{"n":2}') + event(bad) + event(b'{"n":3}'))
    client, stream = await open_leg(url)
    try:
        assert [c["n"] for c in await stream.next_chunks()] == [1, 2]
        with pytest.raises(UpstreamError) as exc:
            await stream.next_chunks()
        assert exc.value.kind == kind
        stream.abort()
    finally:
        await client.close()


async def paced_engine(gaps_s: list[float]) -> tuple[web.AppRunner, str]:
    """An engine writing one chunk after each gap, then [DONE]."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, gap in enumerate(gaps_s):
            await asyncio.sleep(gap)
            await resp.write(event(b'{"choices":[{"text":"%d"}]}' % i))
        await resp.write(event(b"[DONE]"))
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site_port(site)}"


async def test_chunks_within_the_idle_timeout_never_time_out_however_long_the_stream() -> None:
    """The read deadline moves with every chunk (one timer per stream, re-armed when it
    fires early): a stream longer than idle_s whose gaps are shorter reads to its end."""
    runner, url = await paced_engine([0.0, *[0.1] * 6])
    client = UpstreamClient(TimeoutsConfig(idle_s=0.25))
    try:
        stream = await client.open_stream("b", url, "/v1/completions", {})
        texts = []
        while (chunk := await stream.next_chunk()) is not None:
            texts.append(chunk["choices"][0]["text"])
        stream.finish()
        assert texts == [str(i) for i in range(7)]
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_gap_past_the_idle_timeout_is_an_idle_timeout() -> None:
    runner, url = await paced_engine([0.0, 0.05, 1.0])
    client = UpstreamClient(TimeoutsConfig(idle_s=0.2))
    try:
        stream = await client.open_stream("b", url, "/v1/completions", {})
        assert await stream.next_chunk() is not None
        assert await stream.next_chunk() is not None
        with pytest.raises(UpstreamError) as e:
            await stream.next_chunk()
        assert e.value.kind == IDLE_TIMEOUT
        stream.abort()
    finally:
        await client.close()
        await runner.cleanup()


async def test_cancelling_a_reader_is_a_cancellation_not_a_timeout() -> None:
    runner, url = await paced_engine([0.0, 5.0])
    client = UpstreamClient(TimeoutsConfig(idle_s=60.0))
    try:
        stream = await client.open_stream("b", url, "/v1/completions", {})
        assert await stream.next_chunk() is not None
        reader = asyncio.ensure_future(stream.next_chunk())
        await eventually(lambda: stream._reader is not None)  # waiting for data
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        stream.abort()
    finally:
        await client.close()
        await runner.cleanup()


def relay_all_but_the_end() -> tuple[list[bytes], Callable[[deque[bytes]], bool]]:
    """A read callback's relay that takes every event but [DONE], and what it took."""
    relayed: list[bytes] = []

    def relay(events: deque[bytes]) -> bool:
        while events and events[0] != b"[DONE]":
            relayed.append(events.popleft())
        return not events

    return relayed, relay


async def test_chunks_relayed_from_reads_keep_a_sleeping_reader_within_its_idle_timeout() -> None:
    """Chunks taken by the read callback (`relay_from_reads`) never wake the reader, whose
    one wait then lasts longer than idle_s: each of them starts the idle deadline again."""
    runner, url = await paced_engine([0.0, *[0.1] * 6])
    client = UpstreamClient(TimeoutsConfig(idle_s=0.25))
    relayed, relay = relay_all_but_the_end()
    try:
        stream = await client.open_stream("b", url, "/v1/completions", {})
        assert len(await stream.next_payloads()) == 1
        stream.relay_from_reads(relay)
        assert await stream.next_payloads() == []  # woken once, by [DONE]
        stream.finish()
        assert [orjson.loads(p)["choices"][0]["text"] for p in relayed] == [str(i) for i in range(1, 7)]
        assert stream.chunks_read == 7
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_gap_after_relayed_chunks_is_still_an_idle_timeout() -> None:
    runner, url = await paced_engine([0.0, 0.05, 0.05, 1.0])
    client = UpstreamClient(TimeoutsConfig(idle_s=0.2))
    relayed, relay = relay_all_but_the_end()
    try:
        stream = await client.open_stream("b", url, "/v1/completions", {})
        assert len(await stream.next_payloads()) == 1
        stream.relay_from_reads(relay)
        with pytest.raises(UpstreamError) as e:
            await stream.next_payloads()
        assert e.value.kind == IDLE_TIMEOUT
        assert len(relayed) == 2
        stream.abort()
    finally:
        await client.close()
        await runner.cleanup()
