"""The `least_loaded` strategy (router/routing/policies/least_loaded.py): the least predicted
time to first token, blind to the cache."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.routing.costmodel import EngineSpeed
from router.routing.planning import RouteQuery, predicted_ttft
from router.routing.policies.least_loaded import LOAD_BOUND, LeastLoadedStrategy, tie_tolerance_s
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
def test_least_loaded_picks_a_time_the_model_cannot_tell_from_the_least(
    loads: list[tuple[int, int]], salt: int
) -> None:
    views = [view(f"b{i}", queued=q, decoding=d) for i, (q, d) in enumerate(loads)]
    q = RouteQuery("m", "x", salt=salt, prompt_tokens=500)
    chosen = LeastLoadedStrategy(R).plan(q, snap(*views))
    best = min(predicted_ttft(v, 500, 500) for v in views)
    assert chosen.predicted_ttft_s is not None
    assert best <= chosen.predicted_ttft_s <= best + tie_tolerance_s(views[0].speed.ttft(500, 0.0))


def _prompt(group: int, question: int) -> RouteQuery:
    system = f"system prompt of group {group}: " + "be brief. " * 200
    return RouteQuery("m", system + f"question {question}", salt=question * 7919, prompt_tokens=600)


def test_a_repeated_prompt_stays_on_one_engine_while_load_ties() -> None:
    # Idle engines are predicted alike: each group's requests (same system prompt, their
    # own question and salt) go to one engine, not wherever the request id points, and
    # the groups spread over the engines.
    s = snap(*(view(f"d{i}") for i in range(4)))
    strategy = LeastLoadedStrategy(R)
    chosen = {g: {strategy.plan(_prompt(g, k), s).direct for k in range(12)} for g in range(24)}
    assert all(len(engines) == 1 for engines in chosen.values())
    assert len(set().union(*chosen.values())) == 4


def test_a_tie_that_went_by_kv_usage_goes_by_the_prompt() -> None:
    # The engine that just served a prompt still shows its blocks in use at the last
    # scrape: breaking ties on KV usage sent the prompt's next request away from it.
    strategy = LeastLoadedStrategy(R)
    q = _prompt(3, 0)
    home = strategy.plan(q, snap(view("d0"), view("d1"))).direct
    busy_home = snap(*(view(n, kv=0.2 if n == home else 0.0) for n in ("d0", "d1")))
    assert strategy.plan(_prompt(3, 1), busy_home).direct == home


def test_load_breaks_affinity_past_the_bound_or_the_tie() -> None:
    strategy = LeastLoadedStrategy(R)
    q = _prompt(5, 0)
    home = strategy.plan(q, snap(view("d0"), view("d1"))).direct
    assert home is not None
    other = "d1" if home == "d0" else "d0"
    # A prefill queued ahead on the prompt's engine is a difference the model resolves.
    assert strategy.plan(q, snap(view(home, queued=300), view(other))).direct == other
    # A queue that costs more than a share of the prompt's own prefill is not a tie, however
    # long the queue on every engine (the share is of the prompt's time, not the queue's).
    s = snap(view(home, queued=20_000 + 1_000), view(other, queued=20_000))
    assert strategy.plan(q, s).direct == other
    # Decoding sequences within the tie, but more requests there than the bound allows.
    crowded = int(LOAD_BOUND * 4) + 2
    s = snap(view(home, inflight=crowded, decoding=1), view(other))
    assert strategy.plan(q, s).direct == other


def test_the_plan_names_its_runner_up_and_whether_the_tie_rule_chose() -> None:
    strategy = LeastLoadedStrategy(R)
    q = _prompt(7, 0)
    # 300 tokens queued on one engine: the model tells the two apart.
    plan = strategy.plan(q, snap(view("d0", queued=300), view("d1")))
    assert (plan.direct, plan.runner_up, plan.tied) == ("d1", "d0", False)
    assert plan.runner_up_ttft_s == predicted_ttft(view("d0", queued=300), 600, 600)
    # Idle engines tie: the prompt's hash chose, and the plan says so.
    plan = strategy.plan(q, snap(view("d0"), view("d1"), view("d2")))
    assert plan.tied
    assert plan.runner_up in {"d0", "d1", "d2"} - {plan.direct}
    # One engine: nobody to compare with.
    plan = strategy.plan(q, snap(view("d0")))
    assert plan.runner_up is None
    assert not plan.tied
