"""What every strategy shares (router/routing/planning.py): the query's prompt length, the
value of a race, ties spread by the salt, no plan without a decoder."""

from __future__ import annotations

from collections.abc import Mapping

from router.routing.planning import RouteQuery, chosen_plan, direct_plan, fastest, race_value
from router.routing.policies.least_loaded import LeastLoadedStrategy
from router.routing.policies.prefix_tree import PrefixTreeStrategy
from router.routing.policies.probe import ProbeStrategy
from router.routing.policies.round_robin import RoundRobinStrategy
from support.snapshots import SPEED, Q, R, snap, view


def test_race_value_is_what_the_outcome_saved_over_the_cold_choice() -> None:
    s = snap(view("d0", queued=500), view("d1", queued=600))
    plan = ProbeStrategy(R).plan(Q, s)
    assert plan.cold == "d0"
    assert plan.probes == ("d0", "d1")

    def share(winner: str | None, chosen: float | None, reported: Mapping[str, float]) -> float:
        return race_value(plan, s, 1000, {}, winner, chosen, reported)

    assert share("d0", None, {}) == 0.0  # the cold choice itself accepted
    # d1 accepted: as an acceptor (600 + 500 tokens) vs d0 computing it all (500 + 1,000).
    assert abs(share("d1", None, {}) - (SPEED.ttft(1500, 0) - SPEED.ttft(1100, 0)) / 0.1) < 1e-9
    # Nobody accepted; the fallback's choice is predicted 0.03 s sooner than the cold choice.
    assert abs(share(None, SPEED.ttft(1500, 0) - 0.03, {"d0": 0.0}) - 0.3) < 1e-9
    # The memory thought d0 held the prompt; its rejection says it holds nothing: judged
    # by the truth, the race saved what going to d0 would have cost.
    stale = race_value(plan, s, 1000, {"d0": 1000.0}, None, SPEED.ttft(600, 0), {"d0": 0.0})
    assert abs(stale - (SPEED.ttft(1500, 0) - SPEED.ttft(600, 0)) / 0.1) < 1e-9


def test_no_decoder_gives_an_empty_plan() -> None:
    s = snap(view("p", decodes=False, prefills=True))
    for strategy in (ProbeStrategy(R), RoundRobinStrategy(R), LeastLoadedStrategy(R), PrefixTreeStrategy(R)):
        assert strategy.plan(Q, s).empty


def test_ties_spread_with_the_salt() -> None:
    views = [view("a"), view("b"), view("c")]
    assert {fastest(views, lambda b: 100, salt)[0].name for salt in range(3)} == {"a", "b", "c"}


def test_prompt_length_estimate_when_no_engine_reported_it() -> None:
    from router.routing.snapshot import ClusterSnapshot

    # Exact for token ids; else from the learned characters per token (4 until measured).
    assert RouteQuery("m", "5,6,7,", prompt_tokens=3).tokens(ClusterSnapshot(())) == 3
    assert RouteQuery("m", "x" * 4000).tokens(ClusterSnapshot(())) == 1000
    assert RouteQuery("m", "y" * 400).tokens(ClusterSnapshot((), chars_per_token=5.0)) == 80


def test_a_prompts_hits_are_known_only_from_the_index_for_a_tokenized_prompt() -> None:
    ids = tuple(range(100))
    q = RouteQuery("m", "x", prompt_tokens=100, token_ids=ids, indexed={"d0": 64.0, "d1": 0.0})
    assert q.known_hits("d0", 36) == (36, 64)
    assert q.known_hits("d1", 100) == (100, 0)
    # The plan counted more held than the index says (a prompt the engine may still be
    # computing): not known.
    assert q.known_hits("d1", 40) is None
    assert q.known_hits("d2", 100) is None  # its index is not fresh
    assert RouteQuery("m", "x", indexed={"d0": 0.0}).known_hits("d0", 100) is None  # not tokenized


def test_a_direct_plan_names_the_next_best_engine() -> None:
    s = snap(view("d0", queued=500), view("d1", queued=100), view("d2", queued=300))
    plan = direct_plan(Q, s, list(s.backends), {})
    assert (plan.direct, plan.runner_up, plan.tied) == ("d1", "d2", False)
    assert plan.runner_up_ttft_s is not None
    assert plan.predicted_ttft_s is not None
    assert plan.runner_up_ttft_s > plan.predicted_ttft_s
    # Equal predictions: the runner-up is tied (the salt chose between them).
    s = snap(view("d0"), view("d1"))
    plan = direct_plan(Q, s, list(s.backends), {})
    assert plan.tied
    assert {plan.direct, plan.runner_up} == {"d0", "d1"}
    lone = chosen_plan([view("d0")], [1.0], 0, 100)
    assert (lone.direct, lone.prefill_tokens, lone.predicted_ttft_s) == ("d0", 100, 1.0)
    assert (lone.runner_up, lone.runner_up_ttft_s, lone.tied) == (None, None, False)
    views = [view("d0"), view("d1"), view("d2")]
    plan = chosen_plan(views, [3.0, 1.0, 2.0], 1, 100)
    assert (plan.direct, plan.runner_up, plan.runner_up_ttft_s, plan.tied) == ("d1", "d2", 2.0, False)
    plan = chosen_plan(views, [3.0, 1.0, 2.0], 1, 100, tolerance_s=1.0)
    assert (plan.runner_up, plan.runner_up_ttft_s, plan.tied) == ("d2", 2.0, True)
