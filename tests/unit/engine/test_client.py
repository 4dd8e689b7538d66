"""Whole (non-streamed) answers on the hand-written client (`UpstreamClient.post_raw` to a
plain http:// engine: /tokenize, prefill legs, forwarded answers) against a local server
writing exact bytes: each body framing, the bound, a cut or late answer, an error status."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from router.engine.client import UpstreamClient
from router.engine.errors import BROKEN, STATUS, TOO_LARGE, TOTAL_TIMEOUT, UpstreamError
from support.polling import eventually
from support.raw_server import Answer, RawServer, chunk, writes

JSON = b'{"tokens":[1,2,3]}'


async def test_a_whole_answer_in_each_framing_reuses_what_it_can(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    answers = [
        [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", chunk(JSON[:5]), chunk(JSON[5:]), b"0\r\n\r\n"],
        [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(JSON), JSON],
        [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", JSON[:3], JSON[3:]],
    ]

    async def answer(request: bytes, w: asyncio.StreamWriter) -> bool:
        for p in answers[len(server.requests) - 1]:
            w.write(p)
            await w.drain()
        return len(server.requests) < len(answers)

    server = await serve(answer)
    for _ in answers:
        assert await client.post_json("b", server.url, "/tokenize", {"prompt": "p"}) == {"tokens": [1, 2, 3]}
    assert server.connections == 1  # read to close, the last answer ends its connection
    assert server.requests[0].startswith(b"POST /tokenize HTTP/1.1\r\n")


@pytest.mark.parametrize(
    "parts",
    [
        [b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n"],  # declared past the bound
        [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", chunk(b"x" * 6), chunk(b"x" * 6)],
    ],
)
async def test_a_whole_answer_past_its_bound_is_too_large(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient, parts: list[bytes]
) -> None:
    server = await serve(writes(*parts))
    with pytest.raises(UpstreamError) as e:
        await client.post_raw("b", server.url, "/v1/completions", {}, limit=10)
    assert e.value.kind == TOO_LARGE
    assert "10 bytes" in str(e.value)
    await eventually(lambda: server.eofs == 1)  # the rest is not read: the connection is closed


async def test_a_whole_answer_cut_or_late_is_broken_or_timed_out(
    serve: Callable[[Answer], Awaitable[RawServer]], client: UpstreamClient
) -> None:
    cut = await serve(writes(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", JSON, keep=False))
    with pytest.raises(UpstreamError) as e:
        await client.post_raw("b", cut.url, "/v1/completions", {})
    assert e.value.kind == BROKEN
    late = await serve(writes(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", JSON))
    with pytest.raises(UpstreamError) as e:
        await client.post_raw(
            "b", late.url, "/v1/completions", {}, total_deadline=asyncio.get_running_loop().time() + 0.2
        )
    assert e.value.kind == TOTAL_TIMEOUT
    status = await serve(writes(b'HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\n{"error":"x"}'))
    with pytest.raises(UpstreamError) as e:
        await client.post_raw("b", status.url, "/v1/completions", {})
    assert (e.value.kind, e.value.status, e.value.body) == (STATUS, 400, b'{"error":"x"}')
