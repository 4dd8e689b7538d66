"""The arrival check under load: a cold request is rejected at once while the running set
is full, and waits for a slot when the check is off.

Latencies are measured and printed (`-s` shows them), never asserted: this machine is shared.
What is asserted is structural (which finish reason, whether tokens came back, whether a
rejection arrived while the long generations were still running).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from support.busy_engine import counted_rejections, long_body, rejections, words
from support.real_engine import EngineProcess, iter_sse, post_json

# Engine start-up (~2-3 min here, shared session fixture) is charged to the first test.
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]


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
    before = rejections(preemption_engine.base_url)
    result = measure_rejection_under_load(preemption_engine.base_url, 60, "off")
    print(
        f"[arrival check off] (for comparison; rejected at admission once a slot was free)"
        f" {result['latency_ms']:.1f} ms"
    )
    # The structural fact: without the arrival check the scheduler decided, at admission.
    assert counted_rejections(preemption_engine.base_url, before) == {"arrival": 0.0, "admission": 1.0}
