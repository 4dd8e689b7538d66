"""Threshold checks that need a busy engine: re-admission after preemption, and the
admission check when the arrival check is off.

Latencies are measured and printed (`-s` shows them), never asserted: this machine is shared.
What is asserted is structural (which finish reason, whether tokens came back, whether a
rejection arrived while the long generations were still running).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from support.busy_engine import counted_rejections, long_body, metric_growth, rejections, words
from support.real_engine import EngineProcess, iter_sse, post_json, scrape_metrics

# Engine start-up (~2-3 min here, shared session fixture) is charged to the first test.
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]


def _run_stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    tokens: list[int] = []
    finish = None
    prompt_tokens = None
    for event in iter_sse(url, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}):
        if event == "[DONE]":
            break
        for choice in event["choices"]:
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            prompt_tokens = event["usage"]["prompt_tokens"]
    return {
        "mode": "stream",
        "finish_reason": finish,
        "tokens": len(tokens),
        "ids": tokens,
        "prompt_tokens": prompt_tokens,
        "body": body,
    }


def _run_plain(url: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = post_json(url, "/v1/completions", body, timeout=600)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"]
    return {
        "mode": "json",
        "finish_reason": choice["finish_reason"],
        "tokens": answer["usage"]["completion_tokens"],
        "ids": choice["token_ids"],
        "prompt_tokens": answer["usage"]["prompt_tokens"],
        "body": body,
    }


MAX_TOKENS = 140  # with ~81-85 prompt tokens, about --max-model-len 224
BLOCK_TOKENS = 32  # the preemption engine's --block-size (conftest.py)


def two_full_blocks(url: str, tag: str) -> str:
    """A prefix that fills two KV blocks and a few tokens more, counted by the engine's own
    tokenizer: the random tag tokenizes to a varying number of tokens, and one token short
    of two blocks would cache one block only (every request then rejected on arrival)."""
    for n in range(24, 48):
        text = words(n, tag)
        status, answer = post_json(url, "/tokenize", {"model": "tiny", "prompt": text})
        assert status == 200, answer
        if answer["count"] >= 2 * BLOCK_TOKENS + 2:
            return text
    raise AssertionError("no word count gives two full blocks")


MAX_MODEL_LEN = 224  # the preemption engine's (conftest.py)


def test_preempted_request_comes_back_with_cache_threshold_and_its_tokens(preemption_engine: EngineProcess) -> None:
    """8 KV blocks of 32 tokens, two running at a time, four long requests sharing a prefix
    of two full blocks: the running ones outgrow the cache, vLLM preempts one (its blocks are
    freed and soon evicted), and when it is re-admitted its hit rate is 64 / (prompt +
    generated), below the requests' threshold 0.75 (a new request's is 64/~80 ~ 0.8, so it
    is admitted)."""
    url = preemption_engine.base_url
    shared = two_full_blocks(url, uuid.uuid4().hex[:12])
    # Put the shared prefix in the prefix cache (T=0: always served).
    status, _warm = post_json(url, "/v1/completions", long_body(shared, 1))
    assert status == 200
    before = scrape_metrics(url)

    bodies = [long_body(f"{shared} tail{i} end{i}", MAX_TOKENS, threshold=0.75) for i in range(4)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_run_stream if i % 2 == 0 else _run_plain, url, b) for i, b in enumerate(bodies)]
        results = [f.result(timeout=600) for f in futures]
    elapsed = time.monotonic() - t0
    # Stats reach /metrics about once a second.
    preemptions = metric_growth(url, "vllm:num_preemptions_total", before.value("vllm:num_preemptions_total"), 1)
    print(f"\n[preemption] {elapsed:.1f} s, preemptions {preemptions:.0f}, results:")
    for r in results:
        print(f"  {r['mode']:6s} finish={r['finish_reason']:16s} tokens={r['tokens']}")

    assert preemptions >= 1
    rejected = [r for r in results if r["finish_reason"] == "cache_threshold"]
    assert rejected, f"no preempted request was rejected on re-admission: {results}"
    # A request rejected on re-admission returns every token it generated before: exactly
    # the first tokens of the same greedy generation run again without interruption.
    assert any(r["tokens"] > 0 for r in rejected), rejected
    for r in rejected:
        if not r["ids"]:
            continue
        status, again = post_json(
            url, "/v1/completions", {**r["body"], "max_tokens": len(r["ids"]), "cache_hit_threshold": 0}
        )
        assert status == 200
        assert again["choices"][0]["token_ids"] == r["ids"], r["mode"]
    for r in results:
        assert r["finish_reason"] in ("length", "cache_threshold")
        if r["finish_reason"] == "length":
            # max_tokens, or the model length if the prompt (its random tag tokenizes to a
            # few tokens more or less) leaves fewer: vLLM then stops at max_model_len.
            assert r["tokens"] == min(MAX_TOKENS, MAX_MODEL_LEN - r["prompt_tokens"]), r


def test_admission_check_when_arrival_check_is_off(preemption_engine: EngineProcess) -> None:
    """The same rejection, decided by the scheduler at admission (arrival check off)."""
    url = preemption_engine.base_url
    before = rejections(url)
    status, body = post_json(url, "/v1/completions", long_body(words(40), 4, threshold=0.5))
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "cache_threshold"
    assert body["usage"]["completion_tokens"] == 0
    assert counted_rejections(url, before) == {"arrival": 0.0, "admission": 1.0}
