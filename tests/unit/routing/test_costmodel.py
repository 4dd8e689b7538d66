"""The cost model's formula (router/routing/costmodel.py): queue plus lacking tokens at the
engine's speed, prefill/decode overlap, and what a held token costs on a CPU tier."""

from __future__ import annotations

from dataclasses import replace

from router.routing.costmodel import EngineSpeed, ItlSpeed, TransferSpeed, itl, pd_ttft, prefill_stall_s, ttft
from router.routing.fallback import FallbackPlan, plan_fallback
from router.routing.planning import RouteQuery, predicted_ttft
from support.snapshots import SPEED, Q, R, snap, view


def _planned(plan: FallbackPlan | None) -> FallbackPlan:
    assert plan is not None  # there is a decoder
    return plan


def test_a_cpu_tier_hit_costs_more_than_a_gpu_hit_and_less_than_a_recompute() -> None:
    # Both engines hold 800 of the 1,000 tokens; "tiered" loads them from host memory at
    # 5 us per token (a twentieth of recomputing them), "gpu" has them in its prefix cache.
    tiered = view("tiered", speed=replace(SPEED, held_per_token_s=5e-6))
    gpu = view("gpu")
    cold = view("cold")
    hits = {"tiered": 800.0, "gpu": 800.0}
    assert predicted_ttft(tiered, 200, 1000) == ttft(SPEED, 0, 0, 200) + 800 * 5e-6
    assert predicted_ttft(gpu, 200, 1000) == ttft(SPEED, 0, 0, 200)
    for salt in range(4):
        q = RouteQuery("m", Q.text, salt=salt, prompt_tokens=1000)
        assert _planned(plan_fallback(q, snap(tiered, gpu, cold), R, 1000, hits=hits)).decode == "gpu"
        # Without the GPU copy, the CPU copy still beats computing the prompt.
        assert _planned(plan_fallback(q, snap(tiered, cold), R, 1000, hits={"tiered": 800.0})).decode == "tiered"
    # A measured load cost above the recompute cost never makes a hit worse than a miss.
    slow = replace(SPEED, held_per_token_s=1.0)
    assert ttft(slow, 0, 0, 200, 800) == ttft(SPEED, 0, 0, 1000)


def test_ttft_is_queue_plus_lacking_at_the_engine_speed() -> None:
    s = EngineSpeed(intercept_s=0.01, per_token_s=1e-4, per_decode_s=1e-3)
    assert ttft(s, 1000, 0, 500) == 0.01 + 1e-4 * 1500
    assert ttft(s, 0, 20, 0) == 0.01 + 0.02
    # A hit larger than the prompt (an estimate) never makes lacking negative.
    assert ttft(s, 100, 0, -300) == ttft(s, 100, 0, 0)
    # A fit that went negative on a noisy stretch still charges for queued work.
    assert ttft(EngineSpeed(-1.0, -1.0, -1.0), 1000, 10, 0) > 0


def test_prefill_decode_overlaps_the_producer_with_the_consumer_queue() -> None:
    fast = EngineSpeed(0.01, 1e-4, 0.0)
    transfer = TransferSpeed(0.005, 1e-5)
    # Idle consumer: prefill + transfer.
    assert pd_ttft(fast, 0, 0, 1000, fast, 0, 0, transfer, 1000) == 0.01 + 0.1 + 0.005 + 0.01
    # A consumer busy for longer than the prefill: its queue decides.
    assert pd_ttft(fast, 0, 0, 1000, fast, 5000, 0, transfer, 1000) == ttft(fast, 5000, 0, 0)


def test_itl_is_one_step_with_the_request_among_the_decoding_sequences() -> None:
    step = ItlSpeed(step_s=0.01, per_seq_s=1e-3)
    assert itl(step, 9) == 0.01 + 1e-3 * 10
    # A prefill on the engine lengthens each step by its chunk's tokens, at b per token.
    assert prefill_stall_s(SPEED, 300, 8192) == 300 * SPEED.per_token_s
    assert prefill_stall_s(SPEED, 30_000, 8192) == 8192 * SPEED.per_token_s
