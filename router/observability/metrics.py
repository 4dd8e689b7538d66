"""Router metrics (prometheus-client) and the one log line per request, from one place."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.names import BREAKER_STATE_VALUE, BreakerState, Verdict
from router.observability.clientlog import escape
from router.observability.kv_metrics import KvEventGauges
from router.observability.logs import write_request_line
from router.observability.record import RequestRecord
from router.observability.tracing import annotate_request


# What the scrape-time gauges read, as protocols: this layer sits below the registry
# (router.fleet.registry.BackendState), the speed learner and the tenants that fill them.
class _Named(Protocol):
    @property
    def name(self) -> str: ...


class BackendGauges(Protocol):
    @property
    def config(self) -> _Named: ...
    @property
    def inflight(self) -> int: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def breaker(self) -> BreakerState: ...
    @property
    def draining(self) -> bool: ...
    @property
    def queued_tokens(self) -> float: ...
    @property
    def threshold_capable(self) -> bool | None: ...


class _PerToken(Protocol):
    @property
    def per_token_s(self) -> float: ...


class SpeedGauges(Protocol):
    def speed(self, name: str) -> _PerToken: ...


class TenantGauges(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def active(self) -> int: ...
    @property
    def queued(self) -> int: ...


log = logging.getLogger("cachehit_router.requests")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_LONG_BUCKETS = (300.0, 600.0, 900.0, 1800.0, 3600.0)
# Label for a request whose `model` no backend serves (a client's free text must not
# grow the label set without bound).
OTHER_MODEL = "other"


# How many departed backends `RouterMetrics` remembers (see `_gone`).
_GONE_KEPT = 1024


def latency_buckets(total_s: float) -> tuple[float, ...]:
    """Buckets up to the longest a request may last (timeouts.total_s), so that a slow
    answer is not lost in +Inf."""
    out = [b for b in _LATENCY_BUCKETS + _LONG_BUCKETS if b < total_s]
    return (*out, float(total_s))


class RouterMetrics:
    def __init__(
        self, total_s: float = 900.0, served_models: Callable[[], Iterable[str]] = tuple, request_log: bool = True
    ) -> None:
        """`total_s`: timeouts.total_s (the request histograms reach it); `served_models`:
        the models the backends serve now (the `model` label's values); `request_log`:
        one log line per request at INFO (server.request_log)."""
        self.served_models = served_models
        self.request_log = request_log
        buckets = latency_buckets(total_s)
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "cachehit_router_requests",
            "Requests by route, HTTP status and model",
            ["route", "status", "model"],
            registry=r,
        )
        self.probe_rejections = Counter(
            "cachehit_router_probe_rejections",
            "Probes an engine rejected with cache_threshold",
            ["backend"],
            registry=r,
        )
        self.probe_losers = Counter(
            "cachehit_router_probe_losers",
            "Probes cancelled because another engine won the race",
            ["backend"],
            registry=r,
        )
        self.probe_loser_tokens = Counter(
            "cachehit_router_probe_loser_tokens",
            "Tokens the router read from cancelled probe losers",
            ["backend"],
            registry=r,
        )
        self.probe_deadline_expiries = Counter(
            "cachehit_router_probe_deadline_expiries", "Probes silent at the race deadline", ["backend"], registry=r
        )
        self.probe_latency = Histogram(
            "cachehit_router_probe_verdict_seconds",
            "Time from probe start to the engine's verdict",
            ["verdict"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.resumes = Counter("cachehit_router_resumes", "Answers continued on another leg", ["reason"], registry=r)
        self.race_decisions = Counter(
            "cachehit_router_race_decisions", "Why requests raced or did not (RaceReason)", ["reason"], registry=r
        )
        self.retries = Counter(
            "cachehit_router_retries", "Legs retried before the first token", ["backend"], registry=r
        )
        self.upstream_errors = Counter(
            "cachehit_router_upstream_errors", "Upstream failures by kind", ["backend", "kind"], registry=r
        )
        self.ttft = Histogram(
            "cachehit_router_ttft_seconds",
            "Time to first token seen by the client",
            ["model"],
            buckets=buckets,
            registry=r,
        )
        self.duration = Histogram(
            "cachehit_router_request_duration_seconds", "Request duration", ["model"], buckets=buckets, registry=r
        )
        self.inflight = Gauge(
            "cachehit_router_backend_inflight", "Router requests open on a backend", ["backend"], registry=r
        )
        self.healthy = Gauge(
            "cachehit_router_backend_healthy", "1 when the backend takes requests", ["backend"], registry=r
        )
        self.breaker = Gauge(
            "cachehit_router_backend_circuit_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open",
            ["backend"],
            registry=r,
        )
        self.draining = Gauge(
            "cachehit_router_backend_draining",
            "1 while an operator has taken the backend out of rotation",
            ["backend"],
            registry=r,
        )
        self.slow = Gauge(
            "cachehit_router_backend_slow",
            "1 while the backend is avoided because its answers stall (health.slow_engine_s)",
            ["backend"],
            registry=r,
        )
        self.queued_tokens = Gauge(
            "cachehit_router_backend_queued_prefill_tokens",
            "Prompt tokens this router sent that have not reached their first token",
            ["backend"],
            registry=r,
        )
        self.prefill_speed = Gauge(
            "cachehit_router_backend_prefill_tokens_per_second",
            "The cost model's measured prefill speed of the engine",
            ["backend"],
            registry=r,
        )
        self.race_saving_share = Gauge(
            "cachehit_router_race_saving_share",
            "Share of a prompt's prefill time probe races have been saving (measured), "
            "for prompts the router's prefix memory places on an engine or not",
            ["memory"],
            registry=r,
        )
        self.race_wait = Gauge(
            "cachehit_router_race_wait_seconds",
            "What waiting for the verdicts of a race nobody won has been costing (measured)",
            registry=r,
        )
        self.threshold_capable = Gauge(
            "cachehit_router_backend_threshold_capable",
            "1: the engine runs the cache-hit threshold; 0: it does not (never probed); -1: not checked yet",
            ["backend"],
            registry=r,
        )
        self.kv = KvEventGauges(r)  # the engines' KV-event streams (router/observability/kv_metrics.py)
        self.client_inflight = Gauge("cachehit_router_inflight_requests", "Client requests being served", registry=r)
        self.queued = Gauge("cachehit_router_queued_requests", "Client requests waiting for a slot", registry=r)
        self._requests_by: dict[tuple[str, int, str], Counter] = {}
        self._by_model: dict[str, tuple[Histogram, Histogram]] = {}
        self._latency_by: dict[str, Histogram] = {}  # probe_latency's children by verdict
        self.rejected_overload = Counter(
            "cachehit_router_overload_rejections", "Requests answered 429 because the router was full", registry=r
        )
        # Per tenant (an API key's configured name, or key-<digest prefix>; never the key).
        self.tenant_requests = Counter(
            "cachehit_router_tenant_requests", "Requests by tenant and HTTP status", ["tenant", "status"], registry=r
        )
        self.tenant_rejections = Counter(
            "cachehit_router_tenant_rejections",
            "429 answers by tenant and reason (rate, tenant_queue, queue, queue_timeout)",
            ["tenant", "reason"],
            registry=r,
        )
        self.tenant_inflight = Gauge(
            "cachehit_router_tenant_inflight", "Requests of a tenant holding a slot", ["tenant"], registry=r
        )
        self.tenant_queued = Gauge(
            "cachehit_router_tenant_queued", "Requests of a tenant waiting for a slot", ["tenant"], registry=r
        )
        self._tenant_requests_by: dict[tuple[str, int], Counter] = {}
        # Backends that left the fleet, newest last: a request that ends after its engine
        # left must not bring the engine's series back (bounded: such requests end soon).
        self._gone: dict[str, None] = {}

    # The per-backend and per-tenant gauges read their object's state when scraped:
    # nothing to do on the request path, and always the current values.
    def bind_backend(self, s: BackendGauges, learner: SpeedGauges, slow: Callable[[], bool]) -> None:
        """`slow`: whether the backend is avoided now for stalling (router/fleet/stalls.py)."""
        name = s.config.name
        self._gone.pop(name, None)
        self.inflight.labels(name).set_function(lambda: s.inflight)
        self.healthy.labels(name).set_function(lambda: 1 if s.healthy and s.breaker != BreakerState.OPEN else 0)
        self.breaker.labels(name).set_function(lambda: BREAKER_STATE_VALUE[s.breaker])
        self.draining.labels(name).set_function(lambda: 1 if s.draining else 0)
        self.slow.labels(name).set_function(lambda: 1 if slow() else 0)
        self.queued_tokens.labels(name).set_function(lambda: s.queued_tokens)
        self.prefill_speed.labels(name).set_function(lambda: 1.0 / max(learner.speed(name).per_token_s, 1e-9))
        self.threshold_capable.labels(name).set_function(
            lambda: -1 if s.threshold_capable is None else int(s.threshold_capable)
        )

    def unbind_backend(self, name: str) -> None:
        """Every series labelled with a backend that left the fleet goes with it (a fleet
        that churns through addresses must not grow /metrics without bound)."""
        self.kv.unbind(name)
        for gauge in (
            self.inflight,
            self.healthy,
            self.breaker,
            self.draining,
            self.slow,
            self.queued_tokens,
            self.prefill_speed,
            self.threshold_capable,
            self.probe_rejections,
            self.probe_losers,
            self.probe_loser_tokens,
            self.probe_deadline_expiries,
            self.retries,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(name)
        for labels in [k for k in self.upstream_errors._metrics if k[0] == name]:
            self.upstream_errors.remove(*labels)
        self._gone[name] = None
        if len(self._gone) > _GONE_KEPT:
            del self._gone[next(iter(self._gone))]

    def bind_tenant(self, t: TenantGauges) -> None:
        self.tenant_inflight.labels(t.name).set_function(lambda: t.active)
        self.tenant_queued.labels(t.name).set_function(lambda: t.queued)

    def tenant_rejection(self, tenant: str, reason: str) -> None:
        self.tenant_rejections.labels(tenant or "none", reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def record(self, rec: RequestRecord) -> None:
        model = rec.model if rec.model and rec.model in self.served_models() else OTHER_MODEL
        key = (rec.route, rec.status, model)
        counter = self._requests_by.get(key)
        if counter is None:  # labels() builds and locks on every call: look each child up once
            counter = self._requests_by[key] = self.requests.labels(rec.route or "none", str(rec.status), model)
        counter.inc()
        if rec.tenant:
            tenant_key = (rec.tenant, rec.status)
            counter = self._tenant_requests_by.get(tenant_key)
            if counter is None:
                counter = self._tenant_requests_by[tenant_key] = self.tenant_requests.labels(
                    rec.tenant, str(rec.status)
                )
            counter.inc()
        hists = self._by_model.get(model)
        if hists is None:
            hists = self._by_model[model] = (self.ttft.labels(model), self.duration.labels(model))
        if rec.ttft_s is not None:
            hists[0].observe(rec.ttft_s)
        hists[1].observe(rec.duration_s)
        for reason in rec.resumes:
            self.resumes.labels(reason).inc()
        if rec.race_reason:
            self.race_decisions.labels(rec.race_reason).inc()
        gone = self._gone
        for v in rec.verdicts:
            latency = self._latency_by.get(v.verdict)
            if latency is None:
                latency = self._latency_by[v.verdict] = self.probe_latency.labels(v.verdict)
            latency.observe(v.latency_s)
            if v.backend in gone:
                continue
            if v.verdict == Verdict.REJECTED:
                self.probe_rejections.labels(v.backend).inc()
            elif v.verdict == Verdict.LOST:
                self.probe_losers.labels(v.backend).inc()
                self.probe_loser_tokens.labels(v.backend).inc(v.tokens)
            elif v.verdict == Verdict.EXPIRED:
                self.probe_deadline_expiries.labels(v.backend).inc()
        for backend in rec.retried_backends:
            if backend not in gone:
                self.retries.labels(backend).inc()
        for backend, kind in rec.upstream_errors:
            if backend not in gone:
                self.upstream_errors.labels(backend, kind).inc()
        annotate_request(rec)
        if self.request_log and log.isEnabledFor(logging.INFO):
            write_request_line(log, request_fields(rec))  # one JSON line (router/observability/logs.py)


def request_fields(rec: RequestRecord) -> dict[str, object]:
    """The per-request log line's fields, in the line's order. The JSON formatter escapes
    C0 controls; escape() also takes DEL, C1 and invisible characters out of the
    client-supplied fields."""
    f: dict[str, object] = {
        "request_id": escape(rec.request_id),
        "endpoint": rec.endpoint,
        "model": rec.model if rec.model is None else escape(rec.model),
        "stream": rec.stream,
        "tenant": rec.tenant,
        "route": rec.route,
    }
    if rec.race_reason:
        f["race_reason"] = rec.race_reason
    f.update(route_figures(rec))
    if rec.indexed_hits is not None:
        f["indexed_hits"] = rec.indexed_hits
    f["winner"] = rec.winner
    f["prefill"] = rec.prefill
    f["legs"] = rec.legs
    probes = rejections = expired = losers = 0
    for v in rec.verdicts:  # RequestRecord's counts, in one pass
        probes += v.probe
        verdict = v.verdict
        if verdict == Verdict.REJECTED:
            rejections += 1
        elif verdict == Verdict.EXPIRED:
            expired += 1
        elif verdict == Verdict.LOST:
            losers += 1
    f["probes"] = probes
    f["rejections"] = rejections
    f["expired"] = expired
    if rec.rejected_hits:
        f["rejected_hits"] = rec.rejected_hits
    f["losers"] = losers
    f["retries"] = rec.retries
    f["resumes"] = rec.resumes
    f["ttft_ms"] = None if rec.ttft_s is None else round(rec.ttft_s * 1000, 2)
    f["predicted_ttft_ms"] = None if rec.predicted_ttft_s is None else round(rec.predicted_ttft_s * 1000, 2)
    if rec.scratch_ttft_s is not None:
        f["scratch_ttft_ms"] = round(rec.scratch_ttft_s * 1000, 2)
    f["duration_ms"] = round(rec.duration_s * 1000, 2)
    f["status"] = rec.status
    f["prompt_tokens"] = rec.prompt_tokens
    f["completion_tokens"] = rec.completion_tokens
    if rec.error:
        f["error"] = escape(rec.error, 1000)
    return f


def route_figures(rec: RequestRecord) -> dict[str, object]:
    """The log line's why-here fields: the route's reason and the predictions behind it."""
    out: dict[str, object] = {}
    if rec.route_reason:
        out["route_reason"] = rec.route_reason
    if rec.predicted_itl_s is not None:
        out["predicted_itl_ms"] = round(rec.predicted_itl_s * 1000, 2)
    if rec.predicted_lost is not None:
        out["predicted_lost"] = rec.predicted_lost
    if rec.route_alternative:
        out["route_alternative"] = rec.route_alternative
    return out
