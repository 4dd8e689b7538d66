"""One backend's mutable state (`BackendState`): its health and circuit breaker, the load its
scrapes report, and the token-level load of this router's own legs. The registry
(router/fleet/registry.py) owns and updates it; planners see a frozen view of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.config.schema import BackendConfig
from router.fleet.event_sequences import EventSequences, Rates, unseen_prefills
from router.fleet.legs import EngineLegs, LegTicket
from router.fleet.others import OthersLoad
from router.names import BreakerState
from router.routing.costmodel import EngineSpeed


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
    decoding: int = 0  # legs past their first token
    prefilled_tokens: int = 0  # prompt tokens of this router's legs the engine has prefilled, ever
    legs_closed: int = 0  # this router's legs there that ended, ever (a scrape's read spans some: others.py)
    legs: EngineLegs = field(default_factory=EngineLegs)  # what the legs mean for goodput (legs.py)
    # Requests the scrapes saw beyond this router's own legs: other replicas' traffic.
    others: OthersLoad = field(default_factory=OthersLoad)
    # ... and as its KV events show them, between scrapes (fed by router/fleet/kv_events.py).
    sequences: EventSequences = field(default_factory=EventSequences)
    # A decoder whose KV events the router follows: its sequences are seen as they run.
    follows_sequences: bool = field(init=False, default=False)
    threshold_capable: bool | None = None  # router/fleet/capability.py; None: not checked yet
    # LoRA adapters among `models` (/v1/models lists them with a parent; router/fleet/adapters.py).
    adapters: tuple[str, ...] = ()
    adapters_changed: int = 0  # counts the router's own loads and unloads (a check read before one is stale)

    def __post_init__(self) -> None:
        self.follows_sequences = self.config.decodes and bool(self.config.kv_events_endpoint)

    @property
    def prefilling(self) -> int:
        """This router's legs there sent and without a first token yet."""
        return len(self.legs.unanswered)

    @property
    def scraped_decoding(self) -> float:
        """Sequences decoding there: this router's legs past their first token and others'
        as the last scrape saw them (what a leg's speed samples are taken against; a plan
        reads `OthersLoad.decoding`, which may count more)."""
        return self.decoding + self.others.running

    def others_decoding(self, now: float, speed: EngineSpeed, own: Rates | None, fleet: Rates) -> float:
        """Others' sequences there, as the scrapes and the KV events show them, and their
        prompts the events cannot show yet (router/fleet/event_sequences.py; `own`: the
        engine's `others_rates`, None where its sequences are not followed; `fleet`: the
        decoders' mean)."""
        if own is None:
            return self.others.decoding(now)
        shown = max(self.others.decoding(now), self.sequences.others_running(now))
        return shown + unseen_prefills(own, fleet, speed.intercept_s, speed.per_token_s)

    def owe_chain(self, ticket: LegTicket, now: float, at_first_token: bool = False) -> None:
        """The leg stores KV blocks there: the chain it begins is this router's (see
        router/fleet/event_sequences.py for when a leg owes one)."""
        if ticket.owes_chain or not self.follows_sequences:
            return
        ticket.owes_chain = True
        self.sequences.owe(now, at_first_token)
        if ticket.closed:  # owed after it ended: its events may still be on their way
            self.sequences.settle(now)
