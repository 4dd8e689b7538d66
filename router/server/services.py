"""The narrow services each handler is given, as protocols over the running router
(`RouterState` in router/server/state.py, which builds the handlers): a handler sees what it
uses and nothing more, and none of them imports the state that owns it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio

    from aiohttp import web

    from router import errors
    from router.admission.auth import KeyRing
    from router.admission.body_budget import BodyBudget
    from router.admission.limiter import ConcurrencyLimiter
    from router.admission.tenants import Tenant
    from router.config.schema import Config
    from router.dispatch.pipeline import Dispatcher
    from router.engine.client import UpstreamClient
    from router.fleet.adapters import AdapterManager
    from router.fleet.discovery import Discovery
    from router.fleet.membership import Fleet
    from router.fleet.registry import BackendRegistry
    from router.observability.metrics import RouterMetrics
    from router.observability.record import RequestRecord


class Engines(Protocol):
    """What a forwarded request needs: the configuration, the backends and the client."""

    config: Config
    registry: BackendRegistry | None
    client: UpstreamClient | None


class Admission(Protocol):
    """What a client request's handler needs around its own work: who is asking, a slot,
    the drain, the record's metrics."""

    config: Config
    registry: BackendRegistry | None
    dispatcher: Dispatcher | None
    adapters: AdapterManager | None  # LoRA adapters loaded through the router (autoload)
    limiter: ConcurrencyLimiter
    body_budget: BodyBudget
    metrics: RouterMetrics
    draining: bool
    drain_expired: bool
    last_arrival: float
    loop: asyncio.AbstractEventLoop | None  # the serving loop, once started

    def identify(self, request: web.Request) -> tuple[Tenant, int]: ...
    def refused(self, rec: RequestRecord, e: errors.RouterError) -> web.Response: ...
    def request_began(self) -> asyncio.Task[Any] | None: ...
    def request_ended(self, task: asyncio.Task[Any] | None) -> None: ...


class Forwarding(Admission, Engines, Protocol):
    """The forwarded routes: admission plus the engines they relay to."""


class FleetAdmin(Protocol):
    """The admin API: the backends, the fleet that adds and removes them, the admin key."""

    registry: BackendRegistry | None
    fleet: Fleet | None
    keys: KeyRing


class Reloadable(Protocol):
    """A SIGHUP reload: the running configuration and what applies a new one."""

    config: Config
    fleet: Fleet | None
    discovery: Discovery | None

    def apply_config(self, cfg: Config) -> None: ...
