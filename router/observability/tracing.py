"""Optional OpenTelemetry tracing: one span per request, a child span per engine leg.

With `[tracing] enabled = true` the router exports spans over OTLP/HTTP (protobuf) to
`tracing.otlp_endpoint` from a background thread (the SDK's BatchSpanProcessor: nothing
blocks the event loop). Spans:

- the request (`POST /v1/completions`, kind SERVER), a child of the client's
  `traceparent` when it sent one; attributes: status, request id, route, winner, legs,
  probes, retries, resumes, tokens (`annotate_request`, from the per-request record);
- `probe_race` around each race, with one `probe` span per engine it asks;
- one span per engine leg, named for what it is: `probe`, `direct`, `prefill`, `decode`,
  `resume` (every leg after a resume began), `forward` (router/server/forward.py); each lasts as
  long as the leg's connection and carries the backend, the path and how it ended.

Each leg's `traceparent` names the leg's own span, so an engine started with
`--otlp-traces-endpoint` hangs its spans under the router's. Without tracing the client's
trace context is passed through unchanged (router/observability/trace_context.py).

The OpenTelemetry SDK is an optional dependency (`pip install cachehit-router[tracing]`),
imported only when tracing is on; tests pass an in-memory exporter instead of OTLP.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from router.observability.trace_context import (
    pop_upstream_headers,
    push_upstream_headers,
    trace_headers,
    upstream_headers,
)

if TYPE_CHECKING:
    from router.config.schema import TracingConfig
    from router.observability.record import RequestRecord

log = logging.getLogger("cachehit_router.tracing")

LEG_PROBE, LEG_DIRECT, LEG_PREFILL, LEG_DECODE, LEG_RESUME, LEG_FORWARD = (
    "probe",
    "direct",
    "prefill",
    "decode",
    "resume",
    "forward",
)

_TRACER: ContextVar[Any] = ContextVar("cachehit_tracer", default=None)
# Set once a request's answer has been resumed: every later leg is a resume leg.
_RESUMING: ContextVar[bool] = ContextVar("cachehit_resuming", default=False)


class Tracing:
    """The tracer provider of one router and how its spans leave."""

    def __init__(self, cfg: TracingConfig, exporter: Any = None):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
        )
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, timeout=cfg.export_timeout_s)
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        else:  # tests: spans are there as soon as they end
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("cachehit_router")
        self.propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        """Export what is left (the batch processor flushes) and stop."""
        self.provider.shutdown()


def middleware(get_tracing: Callable[[], Tracing | None]) -> Middleware:
    """The request's trace context (and span, with tracing on) for everything it runs."""

    @web.middleware
    async def trace_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        headers = trace_headers(request)
        tracing = get_tracing()
        if tracing is None:
            # Requests of one keep-alive connection can share a task (and a context): reset.
            token = push_upstream_headers(headers)
            try:
                return await handler(request)
            finally:
                pop_upstream_headers(token)
        from opentelemetry import trace

        parent = tracing.propagator.extract(headers) if headers else None
        t_token = _TRACER.set(tracing)
        r_token = _RESUMING.set(False)
        h_token = push_upstream_headers(headers)
        try:
            with tracing.tracer.start_as_current_span(
                f"{request.method} {request.path}",
                context=parent,
                kind=trace.SpanKind.SERVER,
                attributes={"http.request.method": request.method, "url.path": request.path},
            ) as span:
                resp = await handler(request)
                span.set_attribute("http.response.status_code", resp.status)
                if resp.status >= 500:
                    span.set_status(trace.StatusCode.ERROR)
                return resp
        finally:
            pop_upstream_headers(h_token)
            _RESUMING.reset(r_token)
            _TRACER.reset(t_token)

    return trace_middleware


def annotate_request(rec: RequestRecord) -> None:
    """The per-request record's facts on the request span (no-op without tracing)."""
    if _TRACER.get() is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attributes(
        {
            "cachehit.request_id": rec.request_id,
            "cachehit.endpoint": rec.endpoint,
            "cachehit.model": rec.model or "",
            "cachehit.stream": rec.stream,
            "cachehit.route": rec.route,
            "cachehit.winner": rec.winner,
            "cachehit.prefill": rec.prefill,
            "cachehit.legs": rec.legs,
            "cachehit.probes": rec.probes,
            "cachehit.rejections": rec.rejections,
            "cachehit.retries": rec.retries,
            "cachehit.resumes": rec.resumes,
            "cachehit.status": rec.status,
            "cachehit.completion_tokens": rec.completion_tokens,
            **({"cachehit.prompt_tokens": rec.prompt_tokens} if rec.prompt_tokens is not None else {}),
            **({"cachehit.error": rec.error} if rec.error else {}),
        }
    )


def mark_resuming() -> None:
    """Every leg from now on continues an interrupted answer."""
    _RESUMING.set(True)


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current one made current for the block (no-op without tracing)."""
    tracing = _TRACER.get()
    if tracing is None:
        return contextlib.nullcontext()
    manager: contextlib.AbstractContextManager[Any] = tracing.tracer.start_as_current_span(name, attributes=attributes)
    return manager


def leg_kind(path: str, body: dict[str, Any]) -> str:
    """What an engine call is, from what it asks."""
    if _RESUMING.get():
        return LEG_RESUME
    kv = body.get("kv_transfer_params")
    if isinstance(kv, dict):
        return LEG_PREFILL if kv.get("do_remote_decode") else LEG_DECODE
    threshold = body.get("cache_hit_threshold")
    return LEG_PROBE if isinstance(threshold, (int, float)) and threshold > 0 else LEG_DIRECT


def start_leg(kind: str, backend: str, path: str) -> tuple[Any, dict[str, str]]:
    """(span or None, headers for the engine call): with tracing, a leg span child of the
    current one, whose context the engine receives as `traceparent`."""
    tracing = _TRACER.get()
    if tracing is None:
        return None, upstream_headers()
    from opentelemetry import trace

    leg = tracing.tracer.start_span(
        kind,
        kind=trace.SpanKind.CLIENT,
        attributes={"cachehit.backend": backend, "url.path": path, "cachehit.leg": kind},
    )
    headers: dict[str, str] = {}
    tracing.propagator.inject(headers, context=trace.set_span_in_context(leg))
    ts = upstream_headers().get("tracestate")
    if ts and "tracestate" not in headers:
        headers["tracestate"] = ts
    return leg, headers


def end_leg(leg: Any, outcome: str, error: str = "") -> None:
    if leg is None:
        return
    from opentelemetry import trace

    leg.set_attribute("cachehit.outcome", outcome)
    if error:
        leg.set_status(trace.StatusCode.ERROR, error)
    leg.end()
