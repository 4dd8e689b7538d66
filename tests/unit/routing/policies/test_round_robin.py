"""The `round_robin` strategy (router/routing/policies/round_robin.py)."""

from __future__ import annotations

from router.routing.policies.round_robin import RoundRobinStrategy
from support.snapshots import SPEED, Q, R, snap, view


def test_round_robin_cycles_and_still_reports_the_model_prediction() -> None:
    s = snap(view("a"), view("b", queued=500), view("c"))
    rr = RoundRobinStrategy(R)
    plans = [rr.plan(Q, s) for _ in range(6)]
    assert [p.direct for p in plans] == ["a", "b", "c", "a", "b", "c"]
    assert plans[1].predicted_ttft_s == SPEED.ttft(1500, 0)
    assert plans[1].prefill_tokens == 1000
