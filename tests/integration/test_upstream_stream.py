"""UpstreamStream against a real aiohttp server: reading chunks one by one or all that
arrived, and where an unreadable event lands."""

from __future__ import annotations

import functools
import operator
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from router.config.schema import TimeoutsConfig
from router.engine.client import UpstreamClient
from router.engine.errors import ENGINE_ERROR, PROTOCOL, UpstreamError
from router.engine.stream import UpstreamStream
from support.ports import site_port


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
