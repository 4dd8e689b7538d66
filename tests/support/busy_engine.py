"""Requests and counters for the tests that need a busy real engine: prompts of distinct
words, long generations that cannot stop early, and the engine's metrics polled until they
have grown (vLLM publishes engine stats to /metrics about once a second)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from support.real_engine import scrape_metrics

WORDS = [
    "cache",
    "block",
    "token",
    "prefix",
    "request",
    "engine",
    "router",
    "model",
    "stream",
    "prompt",
    "decode",
    "prefill",
    "queue",
    "latency",
    "thread",
    "memory",
    "batch",
    "vector",
    "matrix",
    "kernel",
]


def words(n: int, tag: str | None = None) -> str:
    tag = tag or uuid.uuid4().hex[:12]
    return f"{tag} " + " ".join(f"{WORDS[i % len(WORDS)]}{i}" for i in range(n))


def long_body(prompt: str, max_tokens: int, threshold: float | None = 0.0, **kw: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }
    if threshold is not None:
        body["cache_hit_threshold"] = threshold
    return body


def metric_growth(url: str, name: str, before: float, target: float, timeout_s: float = 30.0) -> float:
    """How much metric `name` grew since `before`, polled until it reaches `target` or the
    deadline passes (vLLM publishes engine stats to /metrics about once a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        grown = scrape_metrics(url).value(name) - before
        if grown >= target or time.monotonic() > deadline:
            return grown
        time.sleep(0.1)


def rejections(url: str) -> dict[str, float]:
    m = scrape_metrics(url)
    # A stage that has rejected nothing yet has no sample: it counts 0.
    return {
        stage: m.sample_or_zero("cachehit_threshold_rejections_total", stage=stage)
        for stage in ("arrival", "admission")
    }


def counted_rejections(url: str, before: dict[str, float], timeout_s: float = 30.0) -> dict[str, float]:
    """The rejection counters' growth since `before`, once a rejection is counted (the
    engine core publishes its counters to the API server a moment after the answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = rejections(url)
        grown = {k: now[k] - before[k] for k in now}
        if sum(grown.values()) >= 1 or time.monotonic() > deadline:
            return grown
        time.sleep(0.1)
