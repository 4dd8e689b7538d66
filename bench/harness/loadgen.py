"""The load generator: an asyncio/aiohttp client that streams completions.

Open loop: each request is sent at its arrival time whether or not earlier ones finished
(`run_open_loop`); multi-turn sessions send turn k+1 after turn k's answer plus a think time
(`run_sessions`). Each request is streamed (`stream: true` with usage), so the client sees
time to first token (first chunk that carries text), inter-token latencies (gaps between
text chunks) and the end; every figure is measured on the client's clock.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.workloads.generators import BenchRequest, Session

MODEL = "sim-model"


@dataclass
class Result:
    index: int
    tag: str = ""
    arrival_s: float = 0.0  # scheduled, relative to the run's start
    start_s: float = 0.0  # actually sent
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    expected_prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    max_tokens: int = 0
    finish_reason: str | None = None
    status: int = 0
    error: str = ""
    response_id: str = ""
    text: str = ""  # kept only for multi-turn (the next turn needs it)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    def row(self) -> dict[str, Any]:
        d = {
            "index": self.index,
            "tag": self.tag,
            "arrival_s": round(self.arrival_s, 4),
            "start_s": round(self.start_s, 4),
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3),
            "e2e_ms": None if self.e2e_ms is None else round(self.e2e_ms, 3),
            "itl_p50_ms": round(statistics.median(self.itl_ms), 3) if self.itl_ms else None,
            "itl_max_ms": round(max(self.itl_ms), 3) if self.itl_ms else None,
            "prompt_tokens": self.prompt_tokens,
            "expected_prompt_tokens": self.expected_prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "max_tokens": self.max_tokens,
            "finish_reason": self.finish_reason,
            "status": self.status,
            "error": self.error,
            "id": self.response_id,
        }
        return d


def completion_body(prompt: str, max_tokens: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
        **(extra or {}),
    }


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    res: Result,
    keep_text: bool = False,
    timeout_s: float = 600.0,
) -> Result:
    t0 = time.perf_counter()
    last = None
    texts: list[str] = []
    try:
        async with session.post(
            url + "/v1/completions",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            res.status = r.status
            if r.status != 200:
                payload = await r.read()
                res.error = f"HTTP {r.status}: {payload[:200].decode(errors='replace')}"
                return res
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                chunk = orjson.loads(payload)
                if "error" in chunk and not chunk.get("choices"):
                    err = chunk["error"]
                    res.error = str(err.get("message") if isinstance(err, dict) else err)[:200]
                    continue
                if not res.response_id:
                    res.response_id = chunk.get("id", "")
                for c in chunk.get("choices") or ():
                    text = c.get("text")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft_ms = (now - t0) * 1000.0
                        else:
                            res.itl_ms.append((now - last) * 1000.0)
                        last = now
                        res.output_tokens += 1
                        if keep_text:
                            texts.append(text)
                    if c.get("finish_reason"):
                        res.finish_reason = c["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    if usage.get("completion_tokens") is not None:
                        res.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    if isinstance(details, dict):
                        res.cached_tokens = details.get("cached_tokens")
    except TimeoutError:
        res.error = f"client timeout after {timeout_s:g} s"
    except aiohttp.ClientError as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        res.e2e_ms = (time.perf_counter() - t0) * 1000.0
        if keep_text:
            res.text = "".join(texts)
    return res


def make_session(connections: int = 0) -> aiohttp.ClientSession:
    conn = aiohttp.TCPConnector(
        limit=connections, limit_per_host=connections, force_close=False, enable_cleanup_closed=True
    )
    return aiohttp.ClientSession(connector=conn)


def _rotation(url: str | Sequence[str]) -> Callable[[], str]:
    """Request k goes to url k mod n: round robin over router replicas, as an L4 load
    balancer spreads connections."""
    urls = [url] if isinstance(url, str) else list(url)
    counter = iter(range(1 << 62))
    return lambda: urls[next(counter) % len(urls)]


async def run_open_loop(
    url: str | Sequence[str],
    reqs: Sequence[BenchRequest],
    *,
    extra_body: dict[str, Any] | None = None,
    max_in_flight: int = 4096,
    timeout_s: float = 600.0,
    progress: Callable[[], object] | None = None,
) -> tuple[list[Result], float]:
    """Send each request at its arrival time (to `url`, or round robin over several);
    returns (results in request order, wall seconds)."""
    next_url = _rotation(url)
    results = [
        Result(
            index=r.index,
            tag=r.tag,
            arrival_s=r.arrival_s,
            max_tokens=r.max_tokens,
            expected_prompt_tokens=r.prompt_tokens,
        )
        for r in reqs
    ]
    sem = asyncio.Semaphore(max_in_flight)
    async with make_session() as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = []

        async def one(r: BenchRequest, res: Result, target: str) -> None:
            async with sem:
                res.start_s = loop.time() - t0
                await stream_completion(
                    session, target, completion_body(r.prompt, r.max_tokens, extra_body), res, timeout_s=timeout_s
                )
                if progress is not None:
                    progress()

        for r, res in zip(reqs, results, strict=False):
            delay = t0 + r.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(r, res, next_url())))
        await asyncio.gather(*tasks)
        wall = loop.time() - t0
    return results, wall


async def run_sessions(
    url: str | Sequence[str],
    sessions: Sequence[Session],
    *,
    extra_body: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
    progress: Callable[[], object] | None = None,
) -> tuple[list[Result], list[str], float]:
    """Multi-turn (every turn to the next of the urls, round robin): returns (results in
    send order, the prompts sent, wall seconds)."""
    next_url = _rotation(url)
    results: list[Result] = []
    prompts: list[str] = []
    async with make_session() as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def run(s: Session) -> None:
            await asyncio.sleep(max(0.0, t0 + s.start_s - loop.time()))
            history = s.system
            for k, msg in enumerate(s.messages):
                prompt = history + msg
                res = Result(index=-1, tag=f"s{s.sid}", arrival_s=loop.time() - t0, max_tokens=s.max_tokens)
                res.start_s = res.arrival_s
                results.append(res)
                prompts.append(prompt)
                res.index = len(results) - 1
                await stream_completion(
                    session,
                    next_url(),
                    completion_body(prompt, s.max_tokens, extra_body),
                    res,
                    keep_text=True,
                    timeout_s=timeout_s,
                )
                if progress is not None:
                    progress()
                if not res.ok:
                    return
                history = prompt + res.text
                if k + 1 < len(s.messages) and s.think_s > 0:
                    await asyncio.sleep(s.think_s)

        await asyncio.gather(*(run(s) for s in sessions))
        wall = loop.time() - t0
    return results, prompts, wall
