"""One backend's mutable state (`BackendState`): its health and circuit breaker, the load its
scrapes report, and the token-level load of this router's own legs. The registry
(router/fleet/registry.py) owns and updates it; planners see a frozen view of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.config.schema import BackendConfig
from router.fleet.legs import EngineLegs
from router.fleet.others import OthersLoad
from router.names import BreakerState
from router.routing.costmodel import NO_ROOM_LIMIT, KvRoom


@dataclass
class BackendState:
    """Every fact the router keeps about one backend: the registry (router/fleet/registry.py) owns it."""

    config: BackendConfig
    models: tuple[str, ...]
    healthy: bool = False
    inflight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    kv_capacity: float = 0.0  # tokens its KV cache holds (scraped cache config; 0: not reported)
    consecutive_failures: int = 0
    check_failures: int = 0  # consecutive failed health checks
    breaker: BreakerState = BreakerState.CLOSED
    opened_at: float = 0.0
    half_open_trial_taken: bool = False
    trial_at: float = 0.0
    last_error: str = ""
    last_scrape_ok: float = 0.0
    draining: bool = False  # set by an operator: no new requests, in-flight ones finish
    # Token-level load from this router's own legs (LegTicket).
    queued_tokens: int = 0
    queue_since: float = 0.0  # the engine began on the oldest of them (legs.queued_ahead)
    prefilling: int = 0  # legs sent, no first token yet
    decoding: int = 0  # legs past their first token
    prefilled_tokens: int = 0  # prompt tokens of this router's legs the engine has prefilled, ever
    legs_closed: int = 0  # this router's legs there that ended, ever (a scrape's read spans some: others.py)
    # The two counts above when the last scrape was recorded: how its KV usage has moved since.
    prefilled_at_scrape: int = 0
    closed_at_scrape: int = 0
    legs: EngineLegs = field(default_factory=EngineLegs)  # what the legs mean for goodput (legs.py)
    # Requests the scrapes saw beyond this router's own legs: other replicas' traffic.
    others: OthersLoad = field(default_factory=OthersLoad)
    threshold_capable: bool | None = None  # router/fleet/capability.py; None: not checked yet
    # LoRA adapters among `models` (/v1/models lists them with a parent; router/fleet/adapters.py).
    adapters: tuple[str, ...] = ()
    adapters_changed: int = 0  # counts the router's own loads and unloads (a check read before one is stale)

    @property
    def scraped_decoding(self) -> float:
        """Sequences decoding there: this router's legs past their first token and others'
        as the last scrape saw them (what a leg's speed samples are taken against; a plan
        reads `OthersLoad.decoding`, which may count more)."""
        return self.decoding + self.others.running

    def kv_room(self, turnover_s: float) -> KvRoom:
        """Its KV cache now (router/routing/costmodel.py `KvRoom`), its running sequences
        replaced every `turnover_s`: the scraped usage, plus the prompts of this router's
        legs prefilled since, less a running sequence's mean share for each of its legs
        that ended since."""
        capacity = self.kv_capacity
        if capacity <= 0.0:
            return NO_ROOM_LIMIT
        scraped = self.kv_usage * capacity
        used = scraped + (self.prefilled_tokens - self.prefilled_at_scrape)
        if self.running > 0.0:
            used -= (self.legs_closed - self.closed_at_scrape) * scraped / self.running
        return KvRoom(capacity, max(used, 0.0), turnover_s)
