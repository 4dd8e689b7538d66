"""A request's stages written into its record (router/dispatch/context.py): here, the
strategy's direct choice carried out as a one-decoder fallback, with its runner-up for the
log line."""

from __future__ import annotations

from router.dispatch.context import fallback_direct, runner_up_figures
from router.names import RouteReason
from router.routing.planning import Plan


def test_a_direct_choice_carries_its_runner_up_into_the_log_figures() -> None:
    plan = Plan(direct="d1", prefill_tokens=600, predicted_ttft_s=0.1, runner_up="d0", runner_up_ttft_s=0.2754)
    fb = fallback_direct(plan)
    assert (fb.decode, fb.prefill, fb.prefill_tokens, fb.predicted_ttft_s) == ("d1", None, 600, 0.1)
    assert fb.reason == RouteReason.DIRECT
    assert fb.alternative == "next d0 ttft=275ms"


def test_a_tie_says_the_tie_rule_chose_and_a_lone_engine_names_nobody() -> None:
    tied = Plan(direct="d1", predicted_ttft_s=0.1, runner_up="d2", runner_up_ttft_s=0.102, tied=True)
    assert runner_up_figures(tied) == "tied d2 ttft=102ms"
    assert runner_up_figures(Plan(direct="d1", predicted_ttft_s=0.1)) == ""
    assert fallback_direct(Plan(direct="d1")).alternative == ""
