"""What one request did, filled in along its path and recorded once at the end: the
record the metrics, the log line and the trace span are all written from."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.names import Verdict
from router.readonly import readonly


@readonly
class EngineVerdict:
    """One engine's verdict in a race, or on a leg sent to it alone (router/dispatch/race.py)."""

    backend: str
    verdict: Verdict
    latency_s: float
    tokens: int = 0  # a loser's tokens, read before it was cancelled
    probe: bool = True  # False: a fallback or decode leg, not a probe


@dataclass
class RequestRecord:
    """What one request did; filled in along its path, recorded once at the end (the
    request's metrics included: `RouterMetrics.record` writes them all from here)."""

    request_id: str
    endpoint: str
    model: str | None
    stream: bool
    route: str = ""  # probe_hit | pd | direct
    winner: str = ""
    legs: list[str] = field(default_factory=list)  # "route:backend" per answer leg
    verdicts: list[EngineVerdict] = field(default_factory=list)
    # Per rejecting engine: the prompt tokens its rejection said it holds (GPU prefix cache
    # and what its KV connector can load, a CPU tier included), when it said.
    rejected_hits: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    retried_backends: list[str] = field(default_factory=list)  # the failed engine per dispatch retry
    upstream_errors: list[tuple[str, str]] = field(default_factory=list)  # (backend, kind)
    resumes: list[str] = field(default_factory=list)
    prefill: str = ""
    ttft_s: float | None = None
    duration_s: float = 0.0
    status: int = 200
    error: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    # The cost model's predicted time to first token (router/routing/costmodel.py), from the
    # dispatcher's start (`dispatch_started`, event-loop time), for accuracy reports.
    predicted_ttft_s: float | None = None
    # For a probe hit: the predicted time to first token of the best engine computing the
    # whole prompt when the race started (did an acceptor ever lose to computing afresh?).
    scratch_ttft_s: float | None = None
    dispatch_started: float = 0.0
    tenant: str = ""  # the API key's tenant name (router/admission/tenants.py), never the key
    race_reason: str = ""  # why the request raced or not (router.names.RaceReason)
    # Why its first leg went where it did (router.names.RouteReason) and the figures that
    # decided it: the chosen placement's predicted gap between tokens and requests it is
    # predicted to put past an SLO, and the best placement of the other kind.
    route_reason: str = ""
    predicted_itl_s: float | None = None
    predicted_lost: float | None = None
    route_alternative: str = ""
    # Per engine the KV-event index spoke for: the prompt tokens it said the engine holds.
    indexed_hits: dict[str, int] | None = None

    @property
    def probes(self) -> int:
        return sum(1 for v in self.verdicts if v.probe)

    @property
    def rejections(self) -> int:
        return self._count(Verdict.REJECTED)

    @property
    def expired(self) -> int:
        return self._count(Verdict.EXPIRED)

    @property
    def losers(self) -> int:
        return self._count(Verdict.LOST)

    @property
    def loser_tokens(self) -> int:
        return sum(v.tokens for v in self.verdicts if v.verdict == Verdict.LOST)

    def _count(self, verdict: Verdict) -> int:
        return sum(1 for v in self.verdicts if v.verdict == verdict)
