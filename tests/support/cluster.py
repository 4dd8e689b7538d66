"""A router in front of simulated engines, all in this test's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from engine_launcher.sim import FaultConfig, SimEngineConfig, SimEngineHandle, start_sim_engine
from engine_launcher.sim.tokenizer import WORDS
from router.config.parse import parse_config
from router.dispatch.pipeline import Dispatcher
from router.fleet.registry import BackendRegistry
from router.server.app import ROUTER_KEY, build_app
from router.server.state import RouterState
from support.metrics import registry_metrics, scrape_metrics
from support.polling import eventually
from support.ports import site_port
from support.sse import read_sse

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

MODEL = "sim-model"
# Fast enough for tests, slow enough that streams are still running when a test looks.
DEFAULT_SPEED = 50.0


@dataclass
class Cluster:
    url: str
    engines: dict[str, SimEngineHandle]
    session: aiohttp.ClientSession
    app: web.Application
    runner: web.AppRunner
    roles: dict[str, str] = field(default_factory=dict)
    # Engine counters (`*_total`) when the cluster became ready: the router's threshold
    # capability check sent each decode engine one request before the test began.
    baseline: dict[tuple[str, str], float] = field(default_factory=dict)

    @property
    def state(self) -> RouterState:
        return self.app[ROUTER_KEY]

    @property
    def registry(self) -> BackendRegistry:
        return registry_of(self.state)

    @property
    def dispatcher(self) -> Dispatcher:
        return dispatcher_of(self.state)

    async def post(self, path: str, body: dict[str, Any], **kw: Any) -> aiohttp.ClientResponse:
        return await self.session.post(
            self.url + path,
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", **kw.pop("headers", {})},
            **kw,
        )

    async def complete(self, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, dict[str, Any]]:
        async with await self.post(path, body) as r:
            return r.status, orjson.loads(await r.read())

    async def stream(self, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, list[Any]]:
        """Returns (status, events): parsed chunks, with "[DONE]" as a string."""
        async with await self.post(path, {**body, "stream": True}) as r:
            if r.status != 200:
                return r.status, [orjson.loads(await r.read())]
            return r.status, await read_sse(r)

    def router_metric(self, name: str, **labels: str) -> float:
        """A router sample summed over the label sets that include `labels` (so a test
        need not name every label, e.g. `model`); fails when the router has no such metric
        or no sample with these labels (support/metrics.py)."""
        return registry_metrics(self.state.metrics.registry).value(name, **labels)

    def router_metric_or_zero(self, name: str, **labels: str) -> float:
        """`router_metric`, but 0.0 for a declared metric with no sample with these labels."""
        return registry_metrics(self.state.metrics.registry).sample_or_zero(name, **labels)

    def routes(self) -> dict[str, float]:
        out = {}
        for route in ("probe_hit", "pd", "direct"):
            out[route] = self.router_metric_or_zero("cachehit_router_requests_total", route=route, status="200")
        return out

    async def engine_metric(self, name: str, metric: str) -> float:
        """An engine's metric read from its own /metrics, summed over label sets; a counter
        counts from when the cluster was ready (see `baseline`)."""
        return await self._raw_engine_metric(name, metric) - self.baseline.get((name, metric), 0.0)

    async def _raw_engine_metric(self, name: str, metric: str) -> float:
        return (await scrape_metrics(self.session, self.engines[name].url)).value(metric)

    async def wait_capability_checked(self, within: float = 15.0) -> None:
        """Until the router knows whether each decode engine runs the threshold, then note
        the engines' counters: tests count from there."""
        states = self.registry.states
        # An engine that fails requests on purpose (fault injection) cannot answer the check.
        failing = {n for n, e in self.engines.items() if e.config.faults.error_rate > 0}
        await eventually(
            lambda: (
                not any(s.threshold_capable is None for n, s in states.items() if s.config.decodes and n not in failing)
            ),
            within,
            "threshold capability checked on every decode engine",
        )
        for n, e in self.engines.items():
            for s in (await scrape_metrics(self.session, e.url)).samples:
                if s.name.endswith("_total"):
                    self.baseline[(n, s.name)] = self.baseline.get((n, s.name), 0.0) + s.value

    async def engine_metrics(self, metric: str) -> dict[str, float]:
        return {n: await self.engine_metric(n, metric) for n in self.engines}

    def engine_running(self) -> dict[str, int]:
        return {n: e.engine.num_running + e.engine.num_waiting for n, e in self.engines.items()}

    async def wait_all_healthy(self, within: float = 15.0) -> None:
        """Until the router has seen every backend answer a health check. Its first check at
        start may time out on a loaded machine (the backend then stays unused until the next
        scrape), and a test that counts where requests went must start from the full set."""
        states = self.registry.states

        def all_healthy() -> bool:
            unhealthy = {n: s.last_error for n, s in states.items() if not s.healthy}
            assert not unhealthy, f"backends the router never saw healthy: {unhealthy}"
            return True

        await eventually(all_healthy, within, "every backend healthy")

    async def wait_idle(self, within: float = 5.0) -> dict[str, int]:
        """Until every engine reports, on its own /metrics, no running and no waiting
        request (vllm:num_requests_running + vllm:num_requests_waiting); returns the last
        counts."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while True:
            counts = {
                n: int(
                    await self.engine_metric(n, "vllm:num_requests_running")
                    + await self.engine_metric(n, "vllm:num_requests_waiting")
                )
                for n in self.engines
            }
            if not any(counts.values()) or loop.time() >= end:
                return counts
            await asyncio.sleep(0.02)


def registry_of(state: RouterState) -> BackendRegistry:
    """The backend registry of a started router (RouterState.start sets it)."""
    assert state.registry is not None, "the router has not started"
    return state.registry


def dispatcher_of(state: RouterState) -> Dispatcher:
    """The dispatcher of a started router (RouterState.start sets it)."""
    assert state.dispatcher is not None, "the router has not started"
    return state.dispatcher


# What the `make_cluster` fixture gives a test: `await make_cluster(decoders=2, ...)`.
MakeCluster = Callable[..., Awaitable[Cluster]]


# Backend priors under which prefill/decode is the cost model's choice for a cold prompt on
# an idle cluster (producer predicted 1,000x faster than the decoders) until measurements
# of the fast simulated decoders replace them: for tests of the split's mechanics.
PD_PREFERRED = {
    **{f"d{i}": {"prefill_tokens_per_s": 1000.0} for i in range(4)},
    **{f"p{i}": {"prefill_tokens_per_s": 1_000_000.0} for i in range(2)},
}


@pytest.fixture
async def make_cluster() -> AsyncIterator[MakeCluster]:
    clusters: list[Cluster] = []

    async def make(
        decoders: int = 2,
        prefillers: int = 0,
        routing: dict[str, Any] | None = None,
        sim: dict[str, Any] | None = None,
        per_engine: dict[str, Any] | None = None,
        timeouts: dict[str, Any] | None = None,
        server: dict[str, Any] | None = None,
        health: dict[str, Any] | None = None,
        per_backend: dict[str, Any] | None = None,
        tracing: dict[str, Any] | None = None,
        span_exporter: SpanExporter | None = None,
        front: Callable[[str, str], Awaitable[str]] | None = None,
    ) -> Cluster:
        """front: `await front(name, engine_url)` gives the URL the router uses for an
        engine instead of its own (a recording proxy in front of it)."""
        engines: dict[str, SimEngineHandle] = {}
        backends: list[dict[str, Any]] = []
        roles: dict[str, str] = {}
        base = SimEngineConfig(**{"model": MODEL, "speed": DEFAULT_SPEED, **(sim or {})})
        names = [(f"d{i}", "consumer", "decode") for i in range(decoders)] + [
            (f"p{i}", "producer", "prefill") for i in range(prefillers)
        ]
        for name, role, brole in names:
            cfg = replace(base, role=role, **((per_engine or {}).get(name, {})))
            engines[name] = await start_sim_engine(cfg, port=0)
            url = engines[name].url if front is None else await front(name, engines[name].url)
            backends.append({"name": name, "url": url, "role": brole, **((per_backend or {}).get(name, {}))})
            roles[name] = brole
        config = parse_config(
            {
                "server": {"port": 0, **(server or {})},
                "routing": {"min_pd_prompt_tokens": 64, **(routing or {})},
                "timeouts": {"first_token_s": 20, "idle_s": 10, "total_s": 60, **(timeouts or {})},
                "health": {"scrape_interval_s": 0.2, "check_interval_s": 0.4, **(health or {})},
                "backends": backends,
                **({"tracing": tracing} if tracing else {}),
            }
        )
        app = build_app(config, start_engines=False, span_exporter=span_exporter)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site_port(site)
        c = Cluster(f"http://127.0.0.1:{port}", engines, aiohttp.ClientSession(), app, runner, roles)
        clusters.append(c)
        await c.wait_all_healthy()
        await c.wait_capability_checked()
        return c

    yield make
    for c in clusters:
        await c.session.close()
        await c.runner.cleanup()
        for e in c.engines.values():
            await e.close()


def long_prompt(tag: str, words: int = 400) -> str:
    """A prompt of exactly `words` simulator tokens (vocabulary words), distinct per tag."""
    start = sum(tag.encode()) * 7919
    return " ".join(WORDS[(start + i * 31) % len(WORDS)] for i in range(words))


__all__ = [
    "MODEL",
    "PD_PREFERRED",
    "Cluster",
    "FaultConfig",
    "MakeCluster",
    "dispatcher_of",
    "long_prompt",
    "registry_of",
]
