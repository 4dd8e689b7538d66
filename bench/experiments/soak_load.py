"""The soak's clients: streamed requests classified as completed, error, lost or hung up,
and the gauges that must return to 0 afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.experiments.soak_procs import MODEL
from router.engine.sse import SSEDecoder


@dataclass
class Result:
    t: float  # completion time, seconds since start
    kind: str  # completed | error | lost | truncated | duplicated | hung_up
    latency_s: float
    ttft_s: float | None
    detail: str = ""
    status: int = 200  # the HTTP status, or the code of an error event in the stream


@dataclass
class Sample:
    t: float
    rss_mib: float
    cpu_pct: float
    inflight: float
    completed: int
    errors: int
    lost: int


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    restarts: list[tuple[float, str]] = field(default_factory=list)
    final_gauges: dict[str, float] = field(default_factory=dict)
    backends_at_end: list[str] = field(default_factory=list)
    churn_steps: int = 0


PREFIXES = [" ".join(f"p{g}w{i}" for i in range(300)) for g in range(6)]


async def one_request(
    s: aiohttp.ClientSession, url: str, rng: random.Random, max_tokens: int, t0: float, bound_s: float
) -> Result:
    prompt = rng.choice(PREFIXES) + f" question {rng.randrange(10**9)}"
    start = time.monotonic()
    ttft = None
    body = orjson.dumps(
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,  # to count the tokens streamed: none lost, none twice
        }
    )
    events: list[Any] = []  # parsed chunks, then "[DONE]"
    try:
        async with asyncio.timeout(bound_s):
            async with s.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                if r.status != 200:
                    raw = await r.read()
                    try:
                        msg = orjson.loads(raw)["error"]["message"]
                    except Exception:
                        return Result(
                            time.monotonic() - t0,
                            "lost",
                            time.monotonic() - start,
                            None,
                            f"HTTP {r.status} without an error body",
                        )
                    return Result(
                        time.monotonic() - t0,
                        "error",
                        time.monotonic() - start,
                        None,
                        f"HTTP {r.status}: {msg}",
                        r.status,
                    )
                decoder = SSEDecoder()
                async for data in r.content.iter_any():
                    if ttft is None:
                        ttft = time.monotonic() - start
                    for p in decoder.feed(data):
                        events.append("[DONE]" if p == b"[DONE]" else orjson.loads(p))
    except TimeoutError:
        return Result(time.monotonic() - t0, "lost", time.monotonic() - start, ttft, f"no end within {bound_s} s")
    except aiohttp.ClientError as e:
        return Result(time.monotonic() - t0, "lost", time.monotonic() - start, ttft, f"connection: {e!r}")
    latency = time.monotonic() - start
    now = time.monotonic() - t0
    chunks = [e for e in events if e != "[DONE]"]
    errs = [c for c in chunks if "error" in c]
    if errs:
        err = errs[0]["error"]
        return Result(now, "error", latency, ttft, f"stream error: {err.get('message')}", int(err.get("code") or 0))
    if not events or events[-1] != "[DONE]":
        return Result(now, "truncated", latency, ttft, "stream ended without [DONE]")
    usage = chunks[-1].get("usage") if chunks else None
    streamed = sum(len(ch.get("token_ids") or ()) for c in chunks for ch in c.get("choices") or ())
    if streamed > max_tokens:
        return Result(now, "duplicated", latency, ttft, f"{streamed} tokens streamed for {max_tokens}")
    if len({c["id"] for c in chunks}) != 1 or not usage or usage.get("completion_tokens") != max_tokens:
        return Result(now, "lost", latency, ttft, f"malformed answer (usage {usage})")
    if streamed < max_tokens:
        return Result(now, "truncated", latency, ttft, f"{streamed} tokens streamed for {max_tokens}")
    return Result(now, "completed", latency, ttft)


async def hang_up_early(port: int, rng: random.Random, max_tokens: int, t0: float) -> Result:
    """Send a streamed request on a raw connection, read for 0-300 ms, then close it."""
    start = time.monotonic()
    body = orjson.dumps(
        {
            "model": MODEL,
            "prompt": rng.choice(PREFIXES) + f" gone {rng.randrange(10**9)}",
            "max_tokens": max_tokens,
            "stream": True,
        }
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(rng.uniform(0.0, 0.3)):
                while await reader.read(65536):
                    pass
    finally:
        writer.transport.abort()
    return Result(time.monotonic() - t0, "hung_up", time.monotonic() - start, None)


GAUGES = (
    "cachehit_router_inflight_requests",
    "cachehit_router_backend_inflight",
    "cachehit_router_queued_requests",
    "cachehit_router_tenant_inflight",
    "cachehit_router_tenant_queued",
)
ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


async def metrics_value(s: aiohttp.ClientSession, url: str, name: str) -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )
