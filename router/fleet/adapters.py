"""LoRA adapters loaded and unloaded through the router, and the router's view of them.

vLLM loads an adapter at run time with `POST /v1/load_lora_adapter {"lora_name",
"lora_path"}` and drops it with `POST /v1/unload_lora_adapter {"lora_name"}` (with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). The router makes these calls for the operator (the
admin routes, router/server/lora_routes.py) and, with `routing.lora_autoload`, for a request
naming a configured adapter no engine holds; each success updates the registry at once
(the health checks' /v1/models read would only see it a check later). The path sent is
always the one `[routing.lora_adapters]` gives for the name: a client never names a path.
A server with DP ranks loads an adapter on all of them: every backend at its address is
updated.
"""

from __future__ import annotations

import asyncio
import logging

from router import errors
from router.config.schema import RoutingConfig
from router.engine.client import UpstreamClient
from router.engine.errors import UpstreamError
from router.fleet.registry import BackendRegistry, BackendState
from router.routing.adapters import engine_for_adapter

log = logging.getLogger("cachehit_router.adapters")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


def is_adapter(registry: BackendRegistry, model: str | None) -> bool:
    """Is `model` a LoRA adapter some engine holds?"""
    return model is not None and any(model in s.adapters for s in registry.states.values())


def holders(registry: BackendRegistry, name: str) -> list[str]:
    return [n for n, s in registry.states.items() if name in s.adapters]


def _same_server(registry: BackendRegistry, backend: str) -> list[BackendState]:
    url = registry.states[backend].config.url
    return [s for s in registry.states.values() if s.config.url == url]


def record_loaded(registry: BackendRegistry, backend: str, name: str) -> None:
    """`backend`'s server holds adapter `name` now."""
    for s in _same_server(registry, backend):
        s.adapters_changed += 1
        if name not in s.models:
            s.models = (*s.models, name)
        if name not in s.adapters:
            s.adapters = (*s.adapters, name)


def record_unloaded(registry: BackendRegistry, backend: str, name: str) -> None:
    """`backend`'s server no longer holds adapter `name`: no request for it goes there."""
    for s in _same_server(registry, backend):
        s.adapters_changed += 1
        s.models = tuple(m for m in s.models if m != name)
        s.adapters = tuple(a for a in s.adapters if a != name)


class AdapterManager:
    """Loads and unloads adapters on engines and keeps the registry's view in step."""

    def __init__(self, routing: RoutingConfig, registry: BackendRegistry, client: UpstreamClient, timeout_s: float):
        self.paths = dict(routing.lora_adapters)
        self.autoload = routing.lora_autoload
        self.max_per_engine = routing.max_adapters_per_engine
        self.registry = registry
        self.client = client
        self.timeout_s = timeout_s
        self._locks: dict[str, asyncio.Lock] = {}

    def configure(self, routing: RoutingConfig) -> None:
        """A reload's new adapter table and bounds."""
        self.paths = dict(routing.lora_adapters)
        self.autoload = routing.lora_autoload
        self.max_per_engine = routing.max_adapters_per_engine

    def path_of(self, name: str) -> str:
        path = self.paths.get(name)
        if path is None:
            known = ", ".join(sorted(self.paths)) or "none"
            raise errors.RouterError(
                404,
                f"No LoRA adapter {name!r} in the router's configuration (routing.lora_adapters: {known}).",
                param="lora_name",
            )
        return path

    async def _call(self, backend: str, path: str, body: dict[str, str]) -> None:
        s = self.registry.states[backend]
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            await self.client.post_raw(
                backend, s.config.url, path, body, api_key=s.config.api_key, total_deadline=deadline
            )
        except UpstreamError as e:
            status = e.status if e.status is not None and 400 <= e.status < 500 else 502
            raise errors.RouterError(
                status, f"Engine {backend} refused {path}: {e.detail}", param="lora_name"
            ) from None

    async def load(self, name: str, backend: str | None = None) -> str:
        """Load adapter `name` on `backend` (None: the engine the cost model picks) and
        return the backend it is on."""
        path = self.path_of(name)
        if backend is None:
            backend = engine_for_adapter(self.registry.snapshot(), self.max_per_engine)
            if backend is None:
                raise errors.RouterError(
                    503,
                    f"No engine has room for LoRA adapter {name!r} (routing.max_adapters_per_engine).",
                    param="lora_name",
                )
        elif backend not in self.registry.states:
            raise errors.RouterError(404, f"No backend named {backend!r}.", param="backend")
        s = self.registry.states[backend]
        if name in s.adapters:
            return backend
        if len(s.adapters) >= self.max_per_engine:
            raise errors.RouterError(
                409,
                f"Backend {backend} holds {len(s.adapters)} adapters (routing.max_adapters_per_engine).",
                param="backend",
            )
        await self._call(backend, LOAD_PATH, {"lora_name": name, "lora_path": path})
        if backend in self.registry.states:
            record_loaded(self.registry, backend, name)
        log.info("LoRA adapter %s loaded on %s", name, backend)
        return backend

    async def unload(self, name: str, backend: str | None = None) -> list[str]:
        """Unload adapter `name` from `backend` (None: every engine holding it); the
        backends it left."""
        if backend is not None and backend not in self.registry.states:
            raise errors.RouterError(404, f"No backend named {backend!r}.", param="backend")
        targets = [backend] if backend is not None else holders(self.registry, name)
        # One call per server: its DP ranks share their adapters.
        seen: set[str] = set()
        done: list[str] = []
        for b in targets:
            state = self.registry.states.get(b)
            if state is None:  # removed from the fleet during an earlier call
                continue
            url = state.config.url
            if url not in seen:
                seen.add(url)
                # The router's view first: no new request goes there while it unloads.
                record_unloaded(self.registry, b, name)
                await self._call(b, UNLOAD_PATH, {"lora_name": name})
                if b in self.registry.states:  # a health check that read the list meanwhile is stale
                    record_unloaded(self.registry, b, name)
                log.info("LoRA adapter %s unloaded from %s", name, b)
            done.append(b)
        return done

    async def ensure(self, model: str | None) -> bool:
        """With `routing.lora_autoload`: a configured adapter no engine holds is loaded on
        the engine the cost model picks (once, however many requests wait for it). True
        when the model is served now because of it."""
        if not self.autoload or model is None or model not in self.paths:
            return False
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            if holders(self.registry, model):
                return True
            await self.load(model)
            return True
