"""One request's dispatch state (`RequestContext`) and the outcomes its stages return.

The stages (router/dispatch/placement.py: race, fallback, one leg; router/dispatch/pipeline.py: pumping a
leg to the client) do I/O and return what happened; the context is the one place that
writes what happened into the request's `RequestRecord`, from which the metrics and the
log line are written at the end (router/observability/metrics.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from router.dispatch.race import ProbeOutcome, RaceResult
from router.engine.errors import UpstreamError
from router.engine.stream import UpstreamStream
from router.fleet.registry import LegTicket
from router.names import RouteReason, Verdict
from router.observability.record import EngineVerdict, RequestRecord
from router.readonly import readonly
from router.routing.fallback import FallbackPlan
from router.routing.planning import Plan, RouteQuery


@dataclass(slots=True)
class Leg:
    """An accepted upstream leg: its chunks become the client's answer."""

    backend: str
    stream: UpstreamStream
    buffered: list[dict[str, Any]]  # chunks the race read before it knew the verdict
    # probe_hit | pd | direct. A pd leg's prompt arrived over NIXL, so its time to first
    # token measures the transfer, not the engine's prefill speed.
    route: str
    ticket: LegTicket | None = None
    text_chars: int = 0  # the routed text's length when the prompt is text (chars per token)


@readonly
class LegOutcome:
    """How a pumped leg ended: `error` None when the engine sent [DONE]."""

    error: UpstreamError | None = None
    # The leg's usage (its last chunk), a speed sample for the cost model.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@readonly
class RaceOutcome:
    """A finished probe race, with the tickets of its legs and when it was sent."""

    plan: Plan
    result: RaceResult
    tickets: dict[str, LegTicket]
    sent: float
    waited_s: float  # from sending the probes to the last verdict

    @property
    def winner(self) -> ProbeOutcome | None:
        return self.result.winner

    @property
    def failed(self) -> list[str]:
        """Engines whose probe failed (connection, status, timeout): kept out after."""
        return [o.backend for o in self.result.by_verdict(Verdict.FAILED)]

    @property
    def last_error(self) -> UpstreamError | None:
        failed = self.result.by_verdict(Verdict.FAILED)
        return failed[-1].error if failed else None


@readonly
class FallbackOutcome:
    """A fallback's result: the accepted leg, or why there is none and whom to keep out."""

    leg: Leg | None
    error: UpstreamError | None = None
    failed: tuple[str, ...] = ()


@dataclass
class RequestContext:
    """What every stage of one dispatch reads: the request as it is sent now (the client's,
    or a resume's continuation), its deadline, the engines kept out, and its record."""

    query: RouteQuery
    path: str
    body: dict[str, Any]
    started: float  # event-loop time the dispatch started
    deadline: float  # the whole answer's (timeouts.total_s)
    record: RequestRecord
    # The running loop, held: asyncio.get_running_loop() costs a getpid() each call.
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    tried: set[str] = field(default_factory=set)  # engines kept out of the next plan

    # --- the record, filled from the stages' outcomes ---------------------------------
    def record_race(self, result: RaceResult, probing: bool = True) -> None:
        rec = self.record
        for o in result.outcomes:
            rec.verdicts.append(
                EngineVerdict(
                    o.backend, o.verdict, o.latency_s, o.tokens_seen if o.verdict == Verdict.LOST else 0, probing
                )
            )
            if o.verdict == Verdict.REJECTED and o.hit_tokens is not None:
                rec.rejected_hits[o.backend] = o.hit_tokens
        if result.prompt_tokens is not None and rec.prompt_tokens is None:
            rec.prompt_tokens = result.prompt_tokens

    def record_plan(self, plan: Plan) -> None:
        """Why the request raced or not, and what the KV-event index said (first plan)."""
        rec = self.record
        if not rec.race_reason and plan.race_reason:
            rec.race_reason = plan.race_reason
        if rec.indexed_hits is None and self.query.indexed is not None:
            rec.indexed_hits = {k: round(v) for k, v in self.query.indexed.items()}

    def record_failure(self, error: UpstreamError) -> None:
        self.record.upstream_errors.append((error.backend, error.kind))

    def record_retry(self, backend: str) -> int:
        """One more retry before the answer's first token (after `backend` failed); the
        request's retries so far."""
        rec = self.record
        rec.retried_backends.append(backend)
        rec.retries += 1
        return rec.retries

    def record_resume(self, reason: str) -> None:
        self.record.resumes.append(reason)

    def record_prefill(self, backend: str) -> None:
        self.record.prefill = backend

    def record_leg(self, route: str, backend: str) -> None:
        """An answer leg was accepted; `route` and `winner` say where the answer was first placed."""
        rec = self.record
        if not rec.route:
            rec.route = route
            rec.winner = backend
        rec.legs.append(f"{route}:{backend}")

    def record_predicted(self, sent: float, predicted_s: float | None) -> None:
        """The cost model's time to first token, for the log: the time the request had spent
        when its first-token leg was sent, plus the model's prediction for that leg."""
        rec = self.record
        if predicted_s is not None and rec.predicted_ttft_s is None:
            rec.predicted_ttft_s = sent - rec.dispatch_started + predicted_s

    def record_placement(self, reason: str, fb: FallbackPlan | None = None) -> None:
        """Why the first leg went where it did, with the predictions that decided it."""
        rec = self.record
        if rec.route_reason:
            return
        rec.route_reason = reason
        if fb is not None:
            rec.predicted_itl_s = fb.predicted_itl_s
            rec.predicted_lost = fb.lost
            rec.route_alternative = fb.alternative

    def record_scratch(self, sent: float, scratch_ttft_s: float | None) -> None:
        rec = self.record
        if scratch_ttft_s is not None and rec.scratch_ttft_s is None:
            rec.scratch_ttft_s = sent - rec.dispatch_started + scratch_ttft_s

    def record_route(self, route: str) -> None:
        """Where an answer forwarded whole (router/server/forward.py) was placed."""
        self.record.route = route

    def record_first_token(self, now: float) -> None:
        if self.record.ttft_s is None:
            self.record.ttft_s = now - self.started


def fallback_direct(plan: Plan) -> FallbackPlan:
    """A strategy's direct choice, carried out like a fallback computed on one decoder."""
    assert plan.direct is not None
    return FallbackPlan(
        decode=plan.direct,
        prefill=None,
        decode_threshold=0.0,
        prefill_tokens=plan.prefill_tokens,
        predicted_ttft_s=plan.predicted_ttft_s,
        reason=RouteReason.DIRECT,
        alternative=runner_up_figures(plan),
    )


def runner_up_figures(plan: Plan) -> str:
    """A direct choice's runner-up for the log line ("next d1 ttft=275ms"; "tied ...": the
    model could not tell the two apart and the strategy's tie rule chose)."""
    if plan.runner_up is None or plan.runner_up_ttft_s is None:
        return ""
    return f"{'tied' if plan.tied else 'next'} {plan.runner_up} ttft={plan.runner_up_ttft_s * 1000:.0f}ms"
