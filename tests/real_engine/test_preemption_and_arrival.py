"""Threshold checks that need a busy engine: re-admission after preemption, the admission
check when the arrival check is off, and the arrival check under load.

Latencies are measured and printed (`-s` shows them), never asserted: this machine is shared.
What is asserted is structural (which finish reason, whether tokens came back, whether a
rejection arrived while the long generations were still running).
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from router.engine.wire import PREFILL_REQUEST_PARAMS
from support.ports import free_port_below_ephemeral_range
from support.real_engine import (
    EngineProcess,
    iter_sse,
    post_json,
    request,
    scrape_metrics,
    scrape_metrics_patiently,
)
from support.sse import parse_sse

# Engine start-up (~2-3 min here, shared session fixture) is charged to the first test.
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

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


# ------------------------------------------------------------------------- preemption


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
    preemptions = _grown(url, "vllm:num_preemptions_total", before.value("vllm:num_preemptions_total"), 1)
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


def _grown(url: str, name: str, before: float, target: float, timeout_s: float = 30.0) -> float:
    """How much metric `name` grew since `before`, polled until it reaches `target` or the
    deadline passes (vLLM publishes engine stats to /metrics about once a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        grown = scrape_metrics(url).value(name) - before
        if grown >= target or time.monotonic() > deadline:
            return grown
        time.sleep(0.1)


def _rejections(url: str) -> dict[str, float]:
    m = scrape_metrics(url)
    # A stage that has rejected nothing yet has no sample: it counts 0.
    return {
        stage: m.sample_or_zero("cachehit_threshold_rejections_total", stage=stage)
        for stage in ("arrival", "admission")
    }


def _counted_rejections(url: str, before: dict[str, float], timeout_s: float = 30.0) -> dict[str, float]:
    """The rejection counters' growth since `before`, once a rejection is counted (the
    engine core publishes its counters to the API server a moment after the answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = _rejections(url)
        grown = {k: now[k] - before[k] for k in now}
        if sum(grown.values()) >= 1 or time.monotonic() > deadline:
            return grown
        time.sleep(0.1)


def test_admission_check_when_arrival_check_is_off(preemption_engine: EngineProcess) -> None:
    """The same rejection, decided by the scheduler at admission (arrival check off)."""
    url = preemption_engine.base_url
    before = _rejections(url)
    status, body = post_json(url, "/v1/completions", long_body(words(40), 4, threshold=0.5))
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "cache_threshold"
    assert body["usage"]["completion_tokens"] == 0
    assert _counted_rejections(url, before) == {"arrival": 0.0, "admission": 1.0}


# ------------------------------------------------------------------------- arrival check


class LongGeneration(threading.Thread):
    """A streamed generation that records when it produced its first token and when it ended."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first_token = threading.Event()
        self.ended_at: float | None = None
        self.tokens = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = iter_sse(self.url, "/v1/completions", {**self.body, "stream": True})
            for event in stream:
                if event == "[DONE]":
                    break
                for choice in event["choices"]:
                    self.tokens += len(choice.get("token_ids") or [])
                if self.tokens:
                    self.first_token.set()
                if self.stop.is_set():
                    stream.close()  # aborts the request in vLLM
                    break
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first_token.set()


def measure_rejection_under_load(url: str, long_tokens: int, label: str) -> dict[str, Any]:
    """Fill the running set (--max-num-seqs 2) with two long generations, then send a cold
    request with T = 0.5 and time its rejection."""
    gens = [LongGeneration(url, long_body(words(5), long_tokens)) for _ in range(2)]
    for g in gens:
        g.start()
    for g in gens:
        assert g.first_token.wait(300), "long generation did not start"
        assert g.error is None, g.error
    t0 = time.monotonic()
    status, body = post_json(url, "/v1/completions", long_body(words(40), 4, threshold=0.5), timeout=600)
    rejected_at = time.monotonic()
    latency_ms = (rejected_at - t0) * 1000
    still_running = [g.ended_at is None or g.ended_at > rejected_at for g in gens]
    tokens_at_rejection = [g.tokens for g in gens]
    for g in gens:
        g.stop.set()
    for g in gens:
        g.join(120)
    print(
        f"\n[arrival check {label}] cold T=0.5 request rejected after {latency_ms:.1f} ms; "
        f"long generations still running: {still_running}, "
        f"their tokens at that moment: {tokens_at_rejection} of {long_tokens}"
    )
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "cache_threshold"
    return {"latency_ms": latency_ms, "still_running": still_running}


def test_arrival_check_rejects_at_once_while_running_set_is_full(threshold_engine: EngineProcess) -> None:
    result = measure_rejection_under_load(threshold_engine.base_url, 400, "on")
    # The structural fact: the engine did not wait for a running slot to free up.
    assert all(result["still_running"]), result


def test_rejection_waits_for_a_slot_without_arrival_check(preemption_engine: EngineProcess) -> None:
    # 2 x (~20 + 60) tokens = 6 blocks: they fit the 7 usable blocks without preemption.
    before = _rejections(preemption_engine.base_url)
    result = measure_rejection_under_load(preemption_engine.base_url, 60, "off")
    print(
        f"[arrival check off] (for comparison; rejected at admission once a slot was free)"
        f" {result['latency_ms']:.1f} ms"
    )
    # The structural fact: without the arrival check the scheduler decided, at admission.
    assert _counted_rejections(preemption_engine.base_url, before) == {"arrival": 0.0, "admission": 1.0}


# ------------------------------------------------------------------------- NIXL decode leg


def test_decode_leg_counts_nixl_tokens_at_arrival_and_admission(
    threshold_engine: EngineProcess, preemption_engine: EngineProcess
) -> None:
    """A cold prompt prefilled on one engine (the prefill leg is never rejected) and decoded
    on the other with T = 0.9: the decode engine (arrival check on) counts the KV it will pull
    over NIXL as hits, so the leg is accepted although its local cache is cold."""
    prompt = words(40)  # ~90 tokens, fits both engines
    prefill = long_body(
        prompt,
        1,
        threshold=0.9,
        ignore_eos=False,
        kv_transfer_params=PREFILL_REQUEST_PARAMS,
    )
    status, answer = post_json(preemption_engine.base_url, "/v1/completions", prefill)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "length"
    kv = answer["kv_transfer_params"]
    assert kv
    assert kv["do_remote_prefill"] is True

    url = threshold_engine.base_url
    before = scrape_metrics(url)
    t0 = time.monotonic()
    status, out = post_json(
        url, "/v1/completions", long_body(prompt, 8, threshold=0.9, kv_transfer_params=kv), timeout=300
    )
    took = time.monotonic() - t0
    assert status == 200, out
    print(f"\n[decode leg] accepted with T=0.9 in {took * 1000:.0f} ms")
    assert out["choices"][0]["finish_reason"] == "length", out
    assert out["usage"]["completion_tokens"] == 8
    external = _grown(
        url,
        "vllm:external_prefix_cache_hits_total",
        before.value("vllm:external_prefix_cache_hits_total"),
        out["usage"]["prompt_tokens"] - 32,
    )
    assert external >= out["usage"]["prompt_tokens"] - 32, external


def test_failed_kv_load_ends_the_decode_leg_with_an_internal_error(
    threshold_engine: EngineProcess, spare_engine: EngineProcess
) -> None:
    """vLLM's default kv_load_failure_policy "fail", which the simulator copies and the router
    recovers from (it computes the prompt on the decoder instead): a decode leg whose
    producer cannot be reached is a 500 "Internal server error", or that error event and
    [DONE] in a stream. The producer here is unreachable (a fresh engine id on a closed
    port), so the NIXL handshake times out (5 s in vLLM 0.32). The consumer is a spare
    engine: vLLM keeps retrying such a handshake, which would stall a shared one
    (conftest.py)."""
    prompt = words(20)
    status, answer = post_json(
        threshold_engine.base_url,
        "/v1/completions",
        long_body(
            prompt,
            1,
            ignore_eos=False,
            kv_transfer_params=PREFILL_REQUEST_PARAMS,
        ),
    )
    assert status == 200, answer
    kv = {
        **answer["kv_transfer_params"],
        "remote_engine_id": str(uuid.uuid4()),
        "remote_host": "127.0.0.1",
        "remote_port": free_port_below_ephemeral_range(),
    }
    url = spare_engine.base_url
    # A just-started engine on a busy core may answer its first scrape late (CI saw > 10 s).
    before = scrape_metrics_patiently(url).value("vllm:nixl_num_failed_transfers_total")
    body = long_body(prompt, 4, kv_transfer_params=kv)
    status, out = post_json(url, "/v1/completions", body, timeout=120)
    assert status == 500, out
    assert out == {
        "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
    }
    status, raw = request(url, "POST", "/v1/completions", {**body, "stream": True}, timeout=120)
    assert status == 200
    assert parse_sse(raw) == [
        {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}},
        "[DONE]",
    ]
    # vLLM publishes NIXL failure counts with its periodic stats: wait for them (the engine
    # may not answer for a while as it retries the handshake, see conftest.py).
    deadline = time.monotonic() + 90
    failed = 0.0
    while time.monotonic() < deadline:
        failed = (
            scrape_metrics_patiently(url, deadline - time.monotonic()).value("vllm:nixl_num_failed_transfers_total")
            - before
        )
        if failed >= 2:
            break
        time.sleep(1.0)
    assert failed >= 2, failed
