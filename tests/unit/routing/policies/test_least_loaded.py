"""The `least_loaded` strategy (router/routing/policies/least_loaded.py): the least predicted
time to first token, blind to the cache."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.routing.costmodel import EngineSpeed
from router.routing.planning import RouteQuery, predicted_ttft
from router.routing.policies.least_loaded import LeastLoadedStrategy
from support.snapshots import Q, R, snap, view


def test_least_loaded_counts_tokens_not_requests() -> None:
    # "a": two short prompts queued (200 tokens); "b": one long one (4,000): b looks less
    # loaded by request count, but a delivers the first token sooner.
    s = snap(view("a", inflight=2, queued=200), view("b", inflight=1, queued=4000))
    assert LeastLoadedStrategy(R).plan(Q, s).direct == "a"
    # Decoding sequences slow every step: 50 decoding (50 ms) outweigh 300 queued tokens (30 ms).
    s = snap(view("a", decoding=50), view("b", queued=300))
    assert LeastLoadedStrategy(R).plan(Q, s).direct == "b"
    # A slower engine (half the prefill speed) loses at equal load.
    slow = EngineSpeed(0.01, 2e-4, 1e-3)
    assert LeastLoadedStrategy(R).plan(Q, snap(view("a", speed=slow), view("b"))).direct == "b"


@given(st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 64)), min_size=1, max_size=6), st.integers(0, 1000))
def test_least_loaded_always_picks_a_least_predicted_time(loads: list[tuple[int, int]], salt: int) -> None:
    views = [view(f"b{i}", queued=q, decoding=d) for i, (q, d) in enumerate(loads)]
    q = RouteQuery("m", "x", salt=salt, prompt_tokens=500)
    chosen = LeastLoadedStrategy(R).plan(q, snap(*views))
    assert chosen.predicted_ttft_s == min(predicted_ttft(v, 500) for v in views)
