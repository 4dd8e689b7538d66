"""The decode leg of a disaggregated request on real engines: KV pulled over NIXL counts as
hits at arrival and admission, and a failed KV load ends the leg with an internal error.
"""

from __future__ import annotations

import time
import uuid

import pytest

from router.engine.wire import PREFILL_REQUEST_PARAMS
from support.busy_engine import long_body, metric_growth, words
from support.ports import free_port_below_ephemeral_range
from support.real_engine import EngineProcess, post_json, request, scrape_metrics, scrape_metrics_patiently
from support.sse import parse_sse

# Engine start-up (~2-3 min here, shared session fixture) is charged to the first test.
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]


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
    external = metric_growth(
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
