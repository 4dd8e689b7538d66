"""Everything one running router owns (`RouterState`): the registry, the client, the
dispatcher, the limiter, the fleet and discovery, the metrics; its lifecycle (start the
engines and the health monitor, drain, stop) and the live part of a reload. It builds the
handlers and gives each the narrow services it uses (router/server/services.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router import errors
from router.admission.auth import KeyRing, request_priority
from router.admission.body_budget import BodyBudget
from router.admission.limiter import ConcurrencyLimiter
from router.admission.tenants import Tenant
from router.config.schema import Config
from router.dispatch.pipeline import Dispatcher
from router.dispatch.prompt_index import PromptIndex
from router.engine.client import UpstreamClient
from router.engine.tokenize import PromptTokenizer
from router.fleet.adapters import AdapterManager
from router.fleet.discovery import Discovery
from router.fleet.engine_starter import EngineStarter, engine_starter
from router.fleet.health import HealthMonitor
from router.fleet.kv_events import KvEvents
from router.fleet.membership import CONFIG, ENGINES, Fleet
from router.fleet.registry import BackendRegistry, BackendState
from router.observability import tracing
from router.observability.metrics import RouterMetrics
from router.observability.record import RequestRecord
from router.routing.fallback import slo_of
from router.routing.kv_index import KvIndex
from router.routing.planning import RemembersPrefixes
from router.routing.policies import make_strategy
from router.routing.speed_learner import SpeedLearner, speed_prior
from router.server.forward import Forwarder
from router.server.generation import GenerationHandler
from router.server.memtrim import IdleTrimmer
from router.server.messages import MessagesHandler
from router.server.respond import error_response, json_response
from router.server.responses import ResponsesHandler

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("cachehit_router.app")


class RouterState:
    """Everything one running router owns."""

    def __init__(self, config: Config, *, start_engines: bool = True, span_exporter: SpanExporter | None = None):
        self.config = config
        # OpenTelemetry ([tracing]); span_exporter: tests' in-memory exporter instead of OTLP.
        self.tracing = tracing.Tracing(config.tracing, span_exporter) if config.tracing.enabled else None
        self.start_engines = start_engines
        # The model label's values: what the backends serve (self.registry, set in start).
        self.metrics = RouterMetrics(
            config.timeouts.total_s,
            lambda: self.registry.models() if self.registry is not None else (),
            config.server.request_log,
        )
        self.limiter = ConcurrencyLimiter(
            config.server.max_concurrent_requests, config.server.max_queued_requests, config.server.queue_timeout_s
        )
        # The bytes of request bodies in flight (router/admission/body_budget.py).
        self.body_budget = BodyBudget(config.server.max_body_bytes_in_flight, config.server.queue_timeout_s)
        # Read at scrape time: always the current queue length.
        self.metrics.queued.set_function(lambda: self.limiter.queued)
        # Client requests being served, also read at scrape time: a plain int on the
        # request path instead of a locked Gauge.inc()/dec() per request.
        self._client_inflight = 0
        self._trimmer = IdleTrimmer()
        self.metrics.client_inflight.set_function(lambda: self._client_inflight)
        self.supervisor: EngineStarter | None = None  # engines started from [[engines]]
        self.registry: BackendRegistry | None = None
        self.client: UpstreamClient | None = None
        self.monitor: HealthMonitor | None = None
        self.dispatcher: Dispatcher | None = None
        self.adapters: AdapterManager | None = None  # LoRA adapters loaded through the router
        self.forwarder = Forwarder(self)  # vLLM's other routes, generations answered whole
        self.generation = GenerationHandler(self, self.forwarder)  # /v1/completions, /v1/chat/completions
        self.messages = MessagesHandler(self.generation, self.forwarder)  # /v1/messages, as a chat completion
        self.responses = ResponsesHandler(self, self.forwarder)  # /v1/responses, placed by a race
        self.keys = KeyRing(config.server.api_keys, config.tenants, config.server.admin_api_key)
        for t in (self.limiter.anonymous, *self.keys.tenants):
            self.metrics.bind_tenant(t)
        self.fleet: Fleet | None = None
        # The engines' KV-event streams and the block index they keep (router/fleet/kv_events.py).
        self.kv_events: KvEvents | None = None
        self.prompt_index: PromptIndex | None = None  # prompts matched against that index
        self.discovery: Discovery | None = None
        # Graceful shutdown (drain): the generation handlers running now, whether the
        # drain is on, and whether it ran out of time (handlers then get cancelled).
        self._handlers: set[asyncio.Task[Any]] = set()
        self.draining = False
        self.drain_expired = False
        self._drained = False
        self.last_arrival = 0.0  # time.monotonic() of the last generation request
        # The serving loop (set in start), held: asyncio.get_running_loop() and
        # current_task() without it cost a getpid() each call.
        self.loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.loop = asyncio.get_running_loop()
        engine_urls: dict[str, str] = {}
        # None: engines started elsewhere (--no-engines), followed at their configured ports.
        engine_events: dict[str, tuple[str, str]] | None = None
        if cfg.engines and self.start_engines:
            self.supervisor = engine_starter(cfg.engines, cfg.launcher)
            log.info("starting %d engine(s) from [[engines]]", len(cfg.engines))
            engine_urls = await self.supervisor.start(progress=_log_progress)
            engine_events = self.supervisor.kv_event_endpoints()
        self.registry = BackendRegistry(
            cfg.all_backends(engine_urls, engine_events), cfg.health, learner=SpeedLearner(speed_prior(cfg.routing))
        )
        learner = self.registry.learner
        self.registry.slo = slo_of(cfg.routing)  # which prefills stall decoding (router/fleet/legs.py)
        self.kv_events = KvEvents(KvIndex(cfg.kv_events.max_blocks_per_engine), self.registry, cfg.kv_events)
        # Looked up per request only once an engine's stream has brought a batch.
        self.registry.kv_fresh, self.registry.kv_index = self.kv_events.fresh, self.kv_events.index
        for s in self.registry.states.values():
            self._backend_added(s)
        self.metrics.race_saving_share.labels("placed").set_function(lambda: learner.race_saving_share)
        self.metrics.race_saving_share.labels("unplaced").set_function(lambda: learner.race_saving_share_unplaced)
        self.metrics.race_wait.set_function(lambda: learner.race_wait_s)
        self.client = UpstreamClient(cfg.timeouts, cfg.server.engine_read_bytes)
        self.client.backend_headers = self.registry.backend_headers  # one live map: DP ranks
        self.monitor = HealthMonitor(self.registry, self.client, cfg.health)
        configured = {b.name for b in cfg.backends}
        self.fleet = Fleet(
            self.registry,
            self.monitor,
            on_added=self._backend_added,
            on_removed=self._backend_removed,
            initial={n: CONFIG if n in configured else ENGINES for n in self.registry.states},
        )
        await self.monitor.check_all()
        self.monitor.start()
        self.discovery = Discovery(self.fleet, cfg.discovery)
        await self.discovery.start()
        registry = self.registry
        self.prompt_index = PromptIndex(
            self.kv_events.index,
            PromptTokenizer(self.client),
            lambda name: (s.config.url, s.config.api_key) if (s := registry.states.get(name)) else None,
        )
        self.dispatcher = Dispatcher(cfg, self.registry, self.client, make_strategy(cfg.routing), self.prompt_index)
        self.adapters = AdapterManager(cfg.routing, self.registry, self.client, cfg.timeouts.first_token_s)
        ready = [n for n, s in self.registry.states.items() if s.healthy]
        log.info(
            "router ready: %d/%d backends healthy (%s), strategy %s",
            len(ready),
            len(self.registry.states),
            ", ".join(ready) or "none",
            cfg.routing.strategy,
        )

    def _backend_added(self, s: BackendState) -> None:
        assert self.registry is not None
        assert self.kv_events is not None
        registry = self.registry
        self.metrics.bind_backend(s, registry.learner, lambda: registry.stalls.slow(s.config.name, registry.clock()))
        kv = self.kv_events
        stream = kv.subscribe(s)
        if stream is not None:
            self.metrics.kv.bind(stream, kv.index, lambda: kv.fresh(s, registry.clock()), s.sequences)

    def _backend_removed(self, name: str) -> None:
        if self.kv_events is not None:
            self.kv_events.unsubscribe(name)
        self.metrics.unbind_backend(name)

    async def drain(self, _app: web.Application | None = None, quiet_s: float = 0.0) -> None:
        """Shutting down (SIGTERM/SIGINT; also on_shutdown): the listening socket is
        already closed. Let the requests in flight finish for up to server.drain_timeout_s,
        then cancel the rest (their upstream requests are aborted, their clients get a 503
        or an error event and [DONE]). The engines are stopped afterwards, in `stop`.

        `router` drains with its open connections still served (cli.py): a request sent
        on one meanwhile gets a 503 with Connection: close. `quiet_s`: then also wait, within
        the drain timeout, until no request arrived for that long, so that a client that
        just received its last answer on a keep-alive connection hears the 503 for its next
        request rather than meeting the connection's close."""
        if self._drained:
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        timeout = self.config.server.drain_timeout_s
        end = loop.time() + timeout
        pending = {t for t in self._handlers if not t.done()}
        if pending:
            log.info("shutting down: draining %d request(s) for up to %g s", len(pending), timeout)
            _, pending = await asyncio.wait(pending, timeout=timeout)
        while not pending and quiet_s > 0:
            quiet_for = time.monotonic() - self.last_arrival
            if quiet_for >= quiet_s or loop.time() >= end:
                break
            await asyncio.sleep(min(quiet_s - quiet_for, end - loop.time()))
        self._drained = True
        if pending:
            log.warning(
                "shutting down: cancelling %d request(s) still running after server.drain_timeout_s = %g s",
                len(pending),
                timeout,
            )
            self.drain_expired = True
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=5.0)

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        if self.fleet is not None:
            await self.fleet.close()
        if self.monitor is not None:
            await self.monitor.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.client is not None:
            await self.client.close()
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.tracing is not None:  # flushes the last spans (blocking HTTP: off the loop)
            await asyncio.to_thread(self.tracing.shutdown)

    def apply_config(self, cfg: Config) -> None:
        """A reload's live keys (router/server/reload.py): requests that start from now on see
        them; those running keep what they started with."""
        assert self.dispatcher is not None
        assert self.registry is not None
        old, self.config = self.config, cfg
        if (cfg.server.api_keys, cfg.server.admin_api_key) != (old.server.api_keys, old.server.admin_api_key):
            self.keys = KeyRing(cfg.server.api_keys, cfg.tenants, cfg.server.admin_api_key).keeping(self.keys)
            for t in self.keys.tenants:
                self.metrics.bind_tenant(t)
        logging.getLogger().setLevel(cfg.server.log_level.upper())
        self.metrics.request_log = cfg.server.request_log
        if cfg.routing != old.routing:
            # The cost model's priors; what it measured since the start stays.
            self.registry.learner.prior = speed_prior(cfg.routing)
            self.registry.slo = slo_of(cfg.routing)
            if self.adapters is not None:
                self.adapters.configure(cfg.routing)
            strategy, before = make_strategy(cfg.routing), self.dispatcher.strategy
            if (
                strategy.name == before.name
                and isinstance(before, RemembersPrefixes)
                and isinstance(strategy, RemembersPrefixes)
            ):
                strategy.memory, strategy.adapter_memories = before.memory, before.adapter_memories
                strategy.memory.resize(cfg.routing.prefix_memory_bytes)
            assert self.client is not None
            self.dispatcher = Dispatcher(cfg, self.registry, self.client, strategy, self.prompt_index)

    def refused(self, rec: RequestRecord, e: errors.RouterError) -> web.Response:
        """The error answer of a request that ended before its answer started, its status on
        the record, and a refusal for overload (429) counted, by tenant limit if one refused."""
        rec.status, rec.error = e.status, e.message
        if e.status == 429:
            self.metrics.rejected_overload.inc()
            if e.reason:
                self.metrics.tenant_rejection(rec.tenant, e.reason)
        return error_response(e)

    def identify(self, request: web.Request) -> tuple[Tenant, int]:
        """The request's tenant (401 for a missing or wrong key) and its priority."""
        tenant = self.limiter.anonymous
        if self.keys.required:
            found = self.keys.tenant_of(request.headers)
            if found is None:
                raise errors.unauthorized()
            tenant = found
        return tenant, request_priority(request.headers, tenant)

    def request_began(self) -> asyncio.Task[Any] | None:
        """A client request is being served: counted, and its handler tracked for the drain."""
        if not self._client_inflight:
            self._trimmer.busy()
        self._client_inflight += 1
        task = asyncio.current_task(self.loop)
        if task is not None:
            self._handlers.add(task)
        return task

    def connection_dropped(self) -> None:
        """A client connection closed holding memory no request accounted for (a large
        request head half received): the heap is trimmed once the router is idle."""
        self._trimmer.freed()

    def request_ended(self, task: asyncio.Task[Any] | None) -> None:
        self._client_inflight -= 1
        if not self._client_inflight:
            self._trimmer.idle()  # the burst is over: give the heap back soon
        if task is not None:
            self._handlers.discard(task)

    # --- handlers (generations: router/server/generation.py; other vLLM routes: router/server/forward.py) ---
    async def handle_models(self, request: web.Request) -> web.Response:
        assert self.registry is not None
        if self.keys.required and self.keys.tenant_of(request.headers) is None:
            return error_response(errors.unauthorized())
        return json_response(self.monitor.models_answer() if self.monitor else {"object": "list", "data": []})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def handle_ready(self, request: web.Request) -> web.Response:
        assert self.registry is not None
        if self.draining:
            return json_response({"status": "not ready", "reason": "shutting down"}, status=503)
        if self.registry.ready():
            return json_response({"status": "ready"})
        return json_response({"status": "not ready", "reason": "no healthy decode backend"}, status=503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )


def _log_progress(event: Any) -> None:
    log.info("engine %s: %s %s", getattr(event, "name", "?"), getattr(event, "state", ""), getattr(event, "detail", ""))
