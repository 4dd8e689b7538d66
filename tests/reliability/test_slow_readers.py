"""Clients that read their stream slower than the engine writes it.

A simulated engine and the router run as real processes. The client asks for a long
streamed answer (about 12 MB of SSE: 30,000 tokens with 5 logprobs each, far more than
any socket buffer on the way) on a socket with a small receive buffer, and then reads
nothing. The router holds at most `server.stream_buffer_bytes` of it for the client and
`server.engine_read_bytes` of the engine leg (plus the bounded socket buffers) and stops
reading the leg; the rest waits at the engine.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING

import aiohttp
import orjson
import pytest

from support.metrics import scrape_metrics
from support.polling import eventually
from support.subprocess_cluster import MODEL, sim_backends

if TYPE_CHECKING:
    from reliability.conftest import Procs  # the `procs` fixture's value

MAX_TOKENS = 30_000
ENGINE_ARGS = ("--speed", "100", "--max-model-len", "40000")


def _body() -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "prompt": "a long answer nobody reads",
            "max_tokens": MAX_TOKENS,
            "logprobs": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def _stalled_client(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send one streamed request from a socket with a 4 KiB receive buffer; read nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    body = _body()
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    return reader, writer


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    """Until the connection ends or the chunked body does (the connection is kept alive)."""
    out = bytearray()
    try:
        while chunk := await reader.read(1 << 20):
            out += chunk
            if out.endswith(b"\r\n0\r\n\r\n"):
                break
    except ConnectionError:
        pass
    return bytes(out)


async def _gauges(s: aiohttp.ClientSession, router_url: str, engine_url: str) -> tuple[float, float, float]:
    rm = await scrape_metrics(s, router_url)
    em = await scrape_metrics(s, engine_url)
    return (
        rm.value("cachehit_router_inflight_requests"),
        rm.value("cachehit_router_backend_inflight"),
        em.value("vllm:num_requests_running"),
    )


@pytest.mark.timeout(120)
async def test_a_client_that_reads_nothing_is_dropped_after_idle_s(procs: Procs) -> None:
    engine = procs.sim(*ENGINE_ARGS)
    router = procs.router({"timeouts": {"idle_s": 1.0, "total_s": 300.0}, "backends": sim_backends({"d0": engine})})
    reader, writer = await _stalled_client(router.port)
    try:
        async with aiohttp.ClientSession() as s:
            # The router's write waits for the client, not for ever: timeouts.idle_s applies
            # to a client that accepts nothing, as it does to an engine that sends nothing.
            # (Before bounded buffering the stream stayed open until total_s.)
            await eventually(
                lambda: _released(s, router.url, engine.url),
                30.0,
                "stalled stream dropped, router gauges and engine back to 0",
            )
        got = await _read_all(reader)
        assert b"data: [DONE]" not in got  # cut, as the client stopped reading
    finally:
        writer.transport.abort()
    assert "read nothing of its stream" in router.log_tail(200)


async def _released(s: aiohttp.ClientSession, router_url: str, engine_url: str) -> tuple[float, float, float] | None:
    g = await _gauges(s, router_url, engine_url)
    return g if g == (0, 0, 0) else None


@pytest.mark.timeout(120)
async def test_a_client_that_pauses_gets_the_whole_answer(procs: Procs) -> None:
    engine = procs.sim(*ENGINE_ARGS)
    router = procs.router({"timeouts": {"idle_s": 60.0, "total_s": 300.0}, "backends": sim_backends({"d0": engine})})
    reader, writer = await _stalled_client(router.port)
    try:
        async with aiohttp.ClientSession() as s:
            # The engine finishes generating while the stream is held back, unread.
            async def generated_but_held() -> tuple[float, float, float] | None:
                g = await _gauges(s, router.url, engine.url)
                em = await scrape_metrics(s, engine.url)
                done = em.value("vllm:generation_tokens_total") >= MAX_TOKENS
                return g if done and g == (1, 1, 0) else None

            await eventually(generated_but_held, 60.0, "answer generated, stream still open at the router")
            got = await _read_all(reader)
            await eventually(lambda: _released(s, router.url, engine.url), 30.0, "gauges back to 0")
            # The engine connection the held answer came on, reused (its reads were paused
            # at the body's end), answers the next request.
            async with asyncio.timeout(20):
                r = await s.post(
                    f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "next", "max_tokens": 4}
                )
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 4
    finally:
        writer.transport.abort()
    head, _, payload = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    # Chunked transfer encoding around the SSE events: undo it.
    events, rest = bytearray(), payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        events += rest[:size]
        rest = rest[size + 2 :]
    lines = [ln[6:] for ln in bytes(events).split(b"\n\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    chunks = [orjson.loads(ln) for ln in lines[:-1]]
    assert not any("error" in c for c in chunks)
    tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"])
    assert tokens == MAX_TOKENS
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
