"""Trace context and OpenTelemetry spans through the router (router/observability/trace_context.py,
router/observability/tracing.py): the client's traceparent reaches every engine leg; with [tracing] on,
one span per request and one per leg, checked with the SDK's in-memory exporter and with
a real OTLP/HTTP receiver (protobuf decoded with opentelemetry-proto)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.fleet.capability import CHECK_PROMPT_PREFIX
from support.cluster import MODEL, PD_PREFERRED, FaultConfig, MakeCluster, long_prompt
from support.ports import site_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


class RecordingFront:
    """A pass-through proxy in front of each engine that records what the router sends."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.runners: list[web.AppRunner] = []
        self.session = aiohttp.ClientSession(auto_decompress=False)

    async def __call__(self, name: str, target: str) -> str:
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            if (
                request.path not in ("/health", "/metrics", "/v1/models") and CHECK_PROMPT_PREFIX.encode() not in body
            ):  # the router's capability check
                self.seen.append(
                    {
                        "engine": name,
                        "path": request.path,
                        "headers": {k.lower(): v for k, v in request.headers.items()},
                    }
                )
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            async with self.session.request(
                request.method, target + request.path_qs, data=body or None, headers=headers
            ) as up:
                out = web.StreamResponse(
                    status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() in ("content-type",)}
                )
                await out.prepare(request)
                async for data in up.content.iter_any():
                    await out.write(data)
                await out.write_eof()
                return out

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{site_port(site)}"

    async def close(self) -> None:
        await self.session.close()
        for r in self.runners:
            await r.cleanup()


@pytest.fixture
async def front() -> AsyncIterator[RecordingFront]:
    f = RecordingFront()
    yield f
    await f.close()


async def test_client_trace_context_reaches_every_engine_leg(make_cluster: MakeCluster, front: RecordingFront) -> None:
    c = await make_cluster(decoders=2, front=front, routing={"race": "always"})
    hdrs = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}
    async with await c.post("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3}, headers=hdrs) as r:
        assert r.status == 200
    async with await c.post("/v1/embeddings", {"model": MODEL, "input": "hello"}, headers=hdrs) as r:
        assert r.status == 200
    legs = [s for s in front.seen if s["path"] in ("/v1/completions", "/v1/embeddings")]
    assert {s["path"] for s in legs} == {"/v1/completions", "/v1/embeddings"}
    assert len(legs) >= 3  # two probes and the forwarded call
    for s in legs:
        assert s["headers"]["traceparent"] == TRACEPARENT
        assert s["headers"]["tracestate"] == "vendor=abc"

    # A malformed traceparent is dropped (W3C: ignore it), and none is invented.
    front.seen.clear()
    for tp in ("00-zz-00f067aa0ba902b7-01", None):
        async with await c.post(
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "max_tokens": 2},
            headers={"traceparent": tp} if tp else {},
        ) as r:
            assert r.status == 200
    assert front.seen
    assert all("traceparent" not in s["headers"] for s in front.seen)


def _by_name(spans: Iterable[ReadableSpan]) -> dict[str, list[Any]]:
    # Read loosely (Any): a finished span's context, parent and attributes are set,
    # though ReadableSpan types them Optional.
    out: dict[str, list[Any]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


async def test_one_span_per_request_and_one_per_leg(make_cluster: MakeCluster, front: RecordingFront) -> None:
    exporter = InMemorySpanExporter()
    c = await make_cluster(
        decoders=2,
        prefillers=1,
        tracing={"enabled": True},
        span_exporter=exporter,
        front=front,
        per_backend=PD_PREFERRED,
        routing={"race": "always"},
    )
    # Cold long prompt: a probe race both decoders reject, then prefill and decode.
    async with await c.post(
        "/v1/completions",
        {"model": MODEL, "prompt": long_prompt("traced", 300), "max_tokens": 4},
        headers={"traceparent": TRACEPARENT},
    ) as r:
        assert r.status == 200, await r.read()
    spans = exporter.get_finished_spans()
    names = _by_name(spans)
    (req,) = names["POST /v1/completions"]
    assert format(req.context.trace_id, "032x") == TRACE_ID
    assert format(req.parent.span_id, "016x") == CLIENT_SPAN  # the client's span is its parent
    assert req.attributes["http.response.status_code"] == 200
    assert req.attributes["cachehit.route"] == "pd"
    (race,) = names["probe_race"]
    assert race.parent.span_id == req.context.span_id
    probes = names["probe"]
    assert len(probes) == 2
    assert all(p.parent.span_id == race.context.span_id for p in probes)
    assert {p.attributes["cachehit.backend"] for p in probes} == {"d0", "d1"}
    (prefill,) = names["prefill"]
    (decode,) = names["decode"]
    assert prefill.attributes["cachehit.backend"] == "p0"
    for leg in (prefill, decode):
        assert leg.parent.span_id == req.context.span_id
        assert leg.context.trace_id == req.context.trace_id
    # Each engine call carried its own leg span as parent.
    leg_ids = {format(s.context.span_id, "016x") for s in [*probes, prefill, decode]}
    sent = {s["headers"]["traceparent"].split("-")[2] for s in front.seen if s["path"] == "/v1/completions"}
    assert sent == leg_ids

    # A forwarded route: the request span and one forward leg.
    exporter.clear()
    async with await c.post("/tokenize", {"model": MODEL, "prompt": "the"}) as r:
        assert r.status == 200
    names = _by_name(exporter.get_finished_spans())
    (req,) = names["POST /tokenize"]
    (fwd,) = names["forward"]
    assert fwd.parent.span_id == req.context.span_id
    assert req.parent is None


async def test_resume_leg_span(make_cluster: MakeCluster) -> None:
    exporter = InMemorySpanExporter()
    c = await make_cluster(
        decoders=2,
        tracing={"enabled": True},
        span_exporter=exporter,
        per_engine={"d0": {"faults": FaultConfig(exit_after_tokens=30)}},
    )
    prompt = long_prompt("resumed", 200)
    async with c.session.post(
        c.engines["d0"].url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
    ) as r:
        assert r.status == 200
    status, out = await c.complete({"model": MODEL, "prompt": prompt, "max_tokens": 80})
    assert status == 200
    assert out["usage"]["completion_tokens"] == 80
    names = _by_name(exporter.get_finished_spans())
    (req,) = names["POST /v1/completions"]
    assert req.attributes["cachehit.resumes"] == ("failure",)
    resumes = names["resume"]
    assert resumes
    assert all(s.attributes["cachehit.backend"] == "d1" for s in resumes)
    winner = [p for p in names["probe"] if p.attributes["cachehit.backend"] == "d0"]
    assert winner
    assert winner[0].attributes["cachehit.outcome"] == "aborted"


async def test_spans_reach_a_real_otlp_http_receiver(make_cluster: MakeCluster) -> None:
    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.headers["Content-Type"] == "application/x-protobuf"
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        received.append(msg)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site_port(site)
    try:
        c = await make_cluster(
            decoders=1,
            tracing={
                "enabled": True,
                "otlp_endpoint": f"http://127.0.0.1:{port}/v1/traces",
                "service_name": "router-under-test",
            },
            routing={"race": "always"},
        )
        status, _ = await c.complete({"model": MODEL, "prompt": "hello", "max_tokens": 2})
        assert status == 200
        # The batch processor exports from its thread; flushing blocks, so off the loop.
        tracing = c.state.tracing
        assert tracing is not None  # [tracing] enabled
        assert await asyncio.to_thread(tracing.provider.force_flush, 10_000)
        spans = [(rs, s) for m in received for rs in m.resource_spans for ss in rs.scope_spans for s in ss.spans]
        names = {s.name for _, s in spans}
        assert {"POST /v1/completions", "probe_race", "probe"} <= names
        services = {a.value.string_value for rs, _ in spans for a in rs.resource.attributes if a.key == "service.name"}
        assert services == {"router-under-test"}
        req = next(s for _, s in spans if s.name == "POST /v1/completions")
        race = next(s for _, s in spans if s.name == "probe_race")
        assert race.parent_span_id == req.span_id
        assert race.trace_id == req.trace_id
    finally:
        await runner.cleanup()


def test_tracing_config_is_checked() -> None:
    from router.config.parse import parse_config
    from router.config.schema import ConfigError

    base = {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    with pytest.raises(ConfigError) as e:
        parse_config({**base, "tracing": {"otlp_endpoint": "ftp://x", "sample_ratio": 2.0}})
    assert {p.split(":")[0] for p in e.value.problems} == {"tracing.otlp_endpoint", "tracing.sample_ratio"}
    assert parse_config({**base, "tracing": {"enabled": True}}).tracing.enabled
    assert orjson.dumps(parse_config(base).to_dict())  # serialisable with the new table
