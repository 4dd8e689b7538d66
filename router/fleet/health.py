"""Active health checks and the load scrape, feeding the backend registry.

Every `scrape_interval_s` each backend's `/metrics` is read for the load view (running,
waiting, KV usage); every `check_interval_s` its `/health` is called too. Either failing
marks the backend unhealthy (skipped by planners) until it answers again. Each backend's
`/v1/models` is read again with every `/health` check: backends whose configuration lists
no models serve what it says (LoRA adapters loaded after start-up included), and the
router's own `/v1/models` shows the engines' entries as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
import orjson

from router.config.schema import BackendConfig, HealthConfig
from router.engine.client import UpstreamClient
from router.engine.scrape import ENGINE_CORES, parse_load_metrics
from router.fleet import capability
from router.fleet.registry import BackendRegistry

log = logging.getLogger("cachehit_router.health")


class HealthMonitor:
    def __init__(self, registry: BackendRegistry, client: UpstreamClient, health: HealthConfig):
        self.registry = registry
        self.client = client
        self.health = health
        self._task: asyncio.Task[Any] | None = None
        self._rounds = 0
        # Backend -> its /v1/models entries as last read (GET /v1/models merges them).
        self.model_cards: dict[str, list[dict[str, Any]]] = {}
        self._took: dict[str, float] = {}  # backend -> how long its check took, this round
        self._undeclared_ranks: set[str] = set()  # DP servers not declared, named once

    @property
    def _timeout_s(self) -> float:
        # Generous: a busy engine (or a busy router host) answers /metrics late, and a
        # late answer is not a dead engine.
        return max(2.0, min(5.0, 2 * self.health.scrape_interval_s))

    async def check(
        self, config: BackendConfig, with_health: bool = True, want_models: bool = False
    ) -> tuple[dict[str, float], tuple[str, ...] | None]:
        """One health check of `config`'s engine (one not registered yet, too: discovery
        checks before adding): its load, and its models when asked for. Raises on any
        failure (connection, timeout, an HTTP error status)."""
        load, cards = await self._read(config, with_health, want_models)
        return load, None if cards is None else tuple(c["id"] for c in cards)

    async def _read(
        self, config: BackendConfig, with_health: bool, want_cards: bool
    ) -> tuple[dict[str, float], list[dict[str, Any]] | None]:
        url, key = config.url, config.api_key
        if with_health:
            status, _ = await self.client.get_text(url + "/health", self._timeout_s, key)
            if status != 200:
                raise RuntimeError(f"/health answered HTTP {status}")
        status, text = await self.client.get_text(url + "/metrics", self._timeout_s, key)
        if status != 200:
            raise RuntimeError(f"/metrics answered HTTP {status}")
        # A DP rank reads its own engine core's samples (vLLM labels them engine="<rank>").
        load = parse_load_metrics(text, str(config.data_parallel_rank) if config.data_parallel_rank >= 0 else None)
        cores = int(load.get(ENGINE_CORES, 1))
        if cores > 1 and config.data_parallel_rank < 0 and config.name not in self._undeclared_ranks:
            self._undeclared_ranks.add(config.name)
            log.warning(
                "backend %s: %d DP ranks behind one address; data_parallel_size = %d routes each",
                config.name,
                cores,
                cores,
            )
        cards = await self._model_cards(url, key) if want_cards else None
        return load, cards

    async def check_one(self, name: str, with_health: bool) -> None:
        state = self.registry.states.get(name)
        if state is None:  # removed from the fleet meanwhile
            return
        url, key = state.config.url, state.config.api_key
        started = time.monotonic()
        changed = state.adapters_changed  # a load or unload through the router while this reads
        closed = state.legs_closed  # legs that end while this reads may be in its counts (others.py)
        try:
            # Models re-read with every /health check: LoRA adapters come and go at runtime.
            load, cards = await self._read(state.config, with_health, with_health or name not in self.model_cards)
        except (TimeoutError, Exception) as e:  # any failure means: not usable now
            if self.registry.states.get(name) is not state:
                return  # replaced meanwhile: this was the old address's answer
            self.registry.record_scrape_failure(name, f"health check: {type(e).__name__}: {e}", definitive_failure(e))
            if not state.healthy:  # checked again when it answers: it may be another engine now
                state.threshold_capable = None
            return
        self._took[name] = time.monotonic() - started  # judged against the round's others (check_all)
        if self.registry.states.get(name) is not state:
            # Removed while it answered, or replaced (a reload moved the name to another
            # address): this answer says nothing about the backend under the name now.
            return
        models = adapters = None
        # No adapter loaded or unloaded through the router since the list was asked for
        # (that list is older than the router's view).
        if cards is not None and state.adapters_changed == changed:
            self.model_cards[name] = cards
            models = tuple(c["id"] for c in cards)
            adapters = tuple(c["id"] for c in cards if c.get("parent"))  # vLLM: a LoRA adapter's base
        self.registry.record_scrape(name, load, models, adapters, closed)
        # Unanswered (an engine failing requests): asked again with the next /health check.
        if state.threshold_capable is None and state.config.decodes and with_health:
            model = state.models[0] if state.models else None
            capable = await capability.threshold_capable(self.client, name, url, key, model, self._timeout_s)
            if capable is not None:
                state.threshold_capable = capable
                capability.report(name, capable)

    def forget(self, name: str) -> None:
        """A backend left the fleet: its models are no longer served through the router."""
        self.model_cards.pop(name, None)

    async def _model_cards(self, url: str, key: str) -> list[dict[str, Any]] | None:
        """The engine's /v1/models entries (vLLM's ModelCard objects), None if unreadable."""
        status, body = await self.client.get_text(url + "/v1/models", self._timeout_s, key)
        if status != 200:
            return None
        try:
            data = orjson.loads(body).get("data")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        if not isinstance(data, list):
            return None
        return [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]

    async def check_all(self, with_health: bool = True) -> None:
        self._took.clear()
        await asyncio.gather(*(self.check_one(n, with_health) for n in list(self.registry.states)))
        # An engine that answers far later than the others did in the same round stalls
        # (router/fleet/stalls.py); a busy router delays the whole round alike.
        self.registry.stalls.check_round(self._took, self.registry.clock())

    async def _run(self) -> None:
        every = max(1, round(self.health.check_interval_s / self.health.scrape_interval_s))
        while True:
            await asyncio.sleep(self.health.scrape_interval_s)
            self._rounds += 1
            try:
                await self.check_all(with_health=self._rounds % every == 0)
            except Exception:  # never let the monitor die
                log.exception("health round failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def models_answer(self) -> dict[str, Any]:
        """vLLM's ModelList over the healthy backends: each model once, as an engine serving it
        describes it (root, parent for a LoRA adapter, max_model_len); a model only known from
        the configuration gets a card of its own."""
        out: dict[str, dict[str, Any]] = {}
        registry, cards = self.registry, self.model_cards
        served = set(registry.models())
        for name, state in registry.states.items():
            if not state.healthy:
                continue
            for c in cards.get(name, ()):
                if c["id"] in served:
                    out.setdefault(c["id"], c)
        created = int(time.time())
        for m in served - out.keys():
            out[m] = {
                "id": m,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": m,
                "parent": None,
                "max_model_len": None,
                "permission": [],
            }
        return {"object": "list", "data": list(out.values())}


def definitive_failure(e: BaseException) -> bool:
    """Refused (nothing listens), or an HTTP error status from the engine: not a timeout,
    which a loaded machine produces too."""
    return isinstance(e, (aiohttp.ClientConnectorError, ConnectionRefusedError, RuntimeError))
