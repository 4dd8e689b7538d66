"""Backend registry: health, circuit breaker, in-flight counts, scraped load, snapshots.

One place owns every fact about a backend. Planners never see this mutable state: they get a `ClusterSnapshot` of
frozen `BackendView`s (router/routing/snapshot.py), so every routing policy is a pure function testable without
sockets.

Health has two sources, kept apart:
- active: a periodic scrape of `/metrics` (load) and `/health` sets `healthy` (see `record_scrape_failure` for
  when a failed check counts);
- passive: the request path reports connection errors, timeouts and 5xx (`record_failure`) and completed
  answers (`record_success`); they drive the circuit breaker.
A per-backend circuit breaker opens after `failure_threshold` consecutive request failures. An open backend
gets no requests (no probes) for `cooldown_s`; then one trial request goes through (half-open) and its success
closes the breaker, its failure opens it again. A good health check does not close the breaker: an engine can
answer /health and /metrics while failing every request. A trial that ends without a verdict (a probe that was
rejected or lost the race) frees the trial slot, and a trial silent for `cooldown_s` lets another one through,
so a breaker never stays half-open for good.

An operator can drain a backend (admin API): it gets no new request or leg, not even as the last resort of panic
routing, while the requests it is serving finish.

Load, for the cost model (router/routing/costmodel.py), is counted in tokens: every leg the router sends holds a
`LegTicket` from `open_leg` to `close_leg`; until its first token (`first_token`) its prompt tokens still to prefill
are queued on the engine, after it the leg is one decoding sequence. The registry's `SpeedLearner` turns finished legs
into each engine's measured speed, and every `BackendView` carries both.

Backends come and go at run time (`router/fleet/membership.py`: admin API, reload, discovery): `add` registers one,
`remove` forgets a drained one once nothing is in flight on it. Feedback for a name that is gone (a health check or a
failure that raced its removal) is ignored."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from router.config.data_parallel import rank_headers
from router.config.schema import BackendConfig, HealthConfig
from router.engine.scrape import HITS_DEVICE, HITS_HOST, KV_USAGE, OFFLOAD_LOAD_TIME, RUNNING, WAITING
from router.fleet.backend_state import BackendState as BackendState  # re-exported: its users import it here
from router.fleet.decayed_rate import DecayedRate
from router.fleet.event_sequences import fleet_rates
from router.fleet.legs import LegTicket as LegTicket  # re-exported: where legs were always imported from
from router.fleet.legs import decode_sample, first_token_sample, queued_ahead, stalls_decoding
from router.fleet.stalls import StallWatch
from router.names import BreakerState
from router.routing.costmodel import EngineSpeed
from router.routing.goodput import Slo
from router.routing.kv_index import KvIndex
from router.routing.snapshot import BackendView, ClusterSnapshot
from router.routing.speed_learner import SpeedLearner

DEFAULT_SLO = Slo()

log = logging.getLogger("cachehit_router.backends")


@dataclass
class BackendRegistry:
    """Mutable backend state; the request path and the scraper update it."""

    configs: Iterable[BackendConfig]
    health: HealthConfig
    clock: Callable[[], float] = time.monotonic
    learner: SpeedLearner = field(default_factory=SpeedLearner)
    # Whether a backend's KV-event index is fresh at a time (router/fleet/kv_events.py).
    kv_fresh: Callable[[BackendState, float], bool] | None = None
    # The engines' KV block index (router/dispatch/prompt_index.py matches prompts with it); None: no streams.
    kv_index: KvIndex | None = None
    slo: Slo | None = None  # goodput's SLOs (routing.slo_*): which prefills stall decoding past them
    # The prompt work asked of the engines lately, tokens per second (router/fleet/decayed_rate.py).
    prompt_work: DecayedRate = field(default_factory=DecayedRate)
    states: dict[str, BackendState] = field(default_factory=dict, init=False)
    # Headers each request to a backend carries (a DP rank's; the upstream client reads it).
    backend_headers: dict[str, dict[str, str]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.stalls = StallWatch(self.health.slow_engine_s)  # engines whose answers stall (router/fleet/stalls.py)
        for c in self.configs:
            self.add(c)

    # --- views -----------------------------------------------------------------------
    def snapshot(self) -> ClusterSnapshot:
        """The backends as a planner sees them now: taken per request, so the views are built
        positionally, in BackendView's field order (tested against views built by keyword)."""
        now, views, learner, kv_fresh = self.clock(), [], self.learner, self.kv_fresh
        removed = self.kv_index.last_removals() if self.kv_index is not None else {}  # one pass
        adapters: set[str] = set()
        rates = {n: s.sequences.others_rates(now) for n, s in self.states.items() if s.follows_sequences}
        fleet = fleet_rates(list(rates.values()))
        for s in self.states.values():
            if s.adapters:
                adapters.update(s.adapters)
            c = s.config
            name = c.name
            speed = learner.speed(name)
            views.append(
                BackendView(
                    name,
                    c.url,
                    c.decodes,
                    c.prefills,
                    s.models,
                    self._available(s, now),
                    s.inflight,
                    s.running,
                    s.waiting,
                    s.kv_usage,
                    s.draining,
                    self._queued_tokens(s, now, speed)[0],
                    s.decoding + s.others_decoding(now, speed, rates.get(name), fleet),
                    s.prefilling,
                    speed,
                    s.threshold_capable is not False,
                    kv_fresh is not None and kv_fresh(s, now),
                    removed.get(name, 0.0),
                    s.others.seen(now) or s.sequences.others_seen(now),
                    s.adapters,
                    learner.itl(name),
                    s.decoding - s.legs.clean,
                    s.legs.kv_awaited_s(now) if s.legs.awaiting_kv else (),
                    s.legs.prefilling_since,
                    self.chunk_of(s),
                )
            )
        return ClusterSnapshot(
            tuple(views),
            learner.transfer(),
            learner.chars_per_token,
            learner.race_wait_s,
            learner.race_saving_share,
            learner.race_saving_share_unplaced,
            frozenset(adapters),
            self.prompt_work.per_s(now),
        )

    def _queued_tokens(self, s: BackendState, now: float, speed: EngineSpeed) -> tuple[float, float]:
        """Prefill tokens ahead of a request sent now, and the same counted whole (legs.py)."""
        others = s.others.waiting * self.learner.mean_prompt_tokens
        return queued_ahead(s.queued_tokens, s.queue_since, others, s.last_scrape_ok, now, speed)

    def _available(self, s: BackendState, now: float) -> bool:
        if s.draining or self.stalls.slow(s.config.name, now):
            return False
        if s.breaker == BreakerState.OPEN:
            # After the cool-down the breaker lets one trial through.
            return s.healthy and now - s.opened_at >= self.health.cooldown_s
        if s.breaker == BreakerState.HALF_OPEN:
            return s.healthy and (not s.half_open_trial_taken or now - s.trial_at >= self.health.cooldown_s)
        return s.healthy

    def ready(self) -> bool:
        return any(v.available and v.decodes for v in self.snapshot().backends)

    def models(self) -> list[str]:
        return list(dict.fromkeys(m for s in self.states.values() if s.healthy for m in s.models))

    # --- operator ----------------------------------------------------------------------
    def add(self, config: BackendConfig) -> BackendState:
        """Register a new backend: unhealthy (no requests) until a health check passes."""
        if config.name in self.states:
            raise ValueError(f"backend {config.name!r} already exists")
        s = self.states[config.name] = BackendState(config=config, models=config.models)
        self._set_headers(config)
        self.learner.add_engine(config.name, config.prefill_tokens_per_s)
        return s

    def _set_headers(self, config: BackendConfig) -> None:
        headers = rank_headers(config)
        if headers:
            self.backend_headers[config.name] = headers

    def remove(self, name: str) -> None:
        """Forget a drained backend with nothing in flight (see `router/fleet/membership.py`)."""
        s = self.states.get(name)
        if s is None:
            return
        if not s.draining or s.inflight:
            raise ValueError(f"backend {name!r} must be drained and idle before removal")
        del self.states[name]
        self.stalls.forget(name)
        self.backend_headers.pop(name, None)
        # A backend added again under this name may be another machine: its speed is learnt anew.
        self.learner.forget_engine(name)

    def accepting(self, name: str) -> BackendState | None:
        """`name`'s state if a new leg may go there now: still in the fleet and not drained since planned."""
        s = self.states.get(name)
        return None if s is None or s.draining else s

    def set_draining(self, name: str, draining: bool) -> None:
        """Take `name` out of rotation (its in-flight requests finish) or put it back."""
        s = self.states[name]
        if s.draining != draining:
            log.warning(
                "backend %s: %s by the operator", name, "draining (no new requests)" if draining else "back in rotation"
            )
        s.draining = draining

    # --- legs: token-level load and speed samples -------------------------------------
    def open_leg(
        self,
        name: str,
        tokens: int = 0,
        kv_wait_s: float | None = None,
        known_hits: tuple[int, int] | None = None,
        stores_blocks: bool | None = None,
    ) -> LegTicket:
        """A leg is being sent to `name` that will prefill about `tokens` prompt tokens
        (0 for a probe: an acceptor's prefill is done by the time it answers); `kv_wait_s`: a
        split's place on its decoder, its TTFT SLO running out in that many seconds;
        `known_hits`: (lacking, held) tokens, known exactly (legs.py); `stores_blocks`: the
        chain of KV blocks it begins is this router's from now (default: if it has tokens)."""
        s, now = self.states[name], self.clock()
        ahead, whole = self._queued_tokens(s, now, self.learner.speed(name))
        ticket = LegTicket(name, max(int(tokens), 0), ahead, s.scraped_decoding, now, whole)
        ticket.known_hits = known_hits
        ticket.stalls = stalls_decoding(self.learner, ticket, self.slo, self.chunk_of(s))
        ticket.kv_deadline = None if kv_wait_s is None else now + kv_wait_s
        s.legs.opened(ticket)
        if s.follows_sequences and (ticket.tokens > 0 if stores_blocks is None else stores_blocks):
            s.owe_chain(ticket, now)
        self.acquire(name)
        if s.queued_tokens <= 0:
            s.queue_since = now
        s.queued_tokens += ticket.tokens
        if ticket.tokens:
            self.prompt_work.add(ticket.tokens, now)
        return ticket

    @property
    def fleet_chunk(self) -> float:
        """The fleet's prefill chunk (vLLM's max_num_batched_tokens: routing.prefill_chunk_tokens)."""
        return (self.slo or DEFAULT_SLO).chunk_tokens

    def chunk_of(self, s: BackendState) -> float:
        """The engine's prefill chunk: its own (`[[backends]] prefill_chunk_tokens`), else the fleet's."""
        return float(s.config.prefill_chunk_tokens) or self.fleet_chunk

    def first_token(self, ticket: LegTicket, at: float | None = None) -> None:
        """The leg's first token arrived: its prefill left the engine's queue."""
        if ticket.first_token_at is not None or ticket.closed:
            return
        ticket.first_token_at = self.clock() if at is None else at
        s = self.states.get(ticket.backend)
        if s is not None:
            t, speed = ticket.first_token_at, self.learner.speed(ticket.backend)
            self.stalls.first_token_of(
                s.config.name, t - ticket.sent_at, ticket.queued_ahead + ticket.tokens, ticket.decoding, speed, t
            )
            s.queued_tokens -= ticket.tokens
            s.queue_since = t  # the legs sent before it are through too
            s.decoding += 1
            s.legs.first_token(ticket)
            s.owe_chain(ticket, t, at_first_token=True)  # a probe taken: it stores blocks too
            s.prefilled_tokens += ticket.tokens
            ticket.decoding_at_first = s.scraped_decoding
            ticket.prefilled_at_first = s.prefilled_tokens
            if ticket.nothing_ahead and not ticket.taught:  # a speed sample to come
                ticket.behind = s.legs.sent_behind(ticket, t)
            if ticket.known_hits is not None:  # a sample now, seconds before its usage arrives
                first_token_sample(self.learner, ticket, *ticket.known_hits, self.chunk_of(s))

    def may_have_stored(self, tickets: Iterable[LegTicket | None]) -> None:
        """Race legs dropped once their engine may have begun on them (lost, expired): theirs too."""
        now = self.clock()
        for t in tickets:
            if t is not None and (s := self.states.get(t.backend)) is not None:
                s.owe_chain(t, now, at_first_token=True)

    def close_leg(self, ticket: LegTicket) -> None:
        """The leg ended (finished, failed, cancelled). Safe to call more than once."""
        if ticket.closed:
            return
        ticket.closed = True
        s = self.states.get(ticket.backend)
        if s is None:
            return
        s.legs.closed(ticket)
        if ticket.owes_chain:
            s.sequences.settle(self.clock())
        if ticket.first_token_at is None:
            s.queued_tokens -= ticket.tokens
        else:
            s.decoding -= 1
        s.legs_closed += 1
        self.release(ticket.backend)

    def learn_first_token(self, ticket: LegTicket, lacking_tokens: int, held_tokens: int = 0) -> float | None:
        """A leg's first-token speed sample (legs.py); the observed seconds to first token."""
        s = self.states.get(ticket.backend)
        chunk = self.chunk_of(s) if s is not None else self.fleet_chunk
        return first_token_sample(self.learner, ticket, lacking_tokens, held_tokens, chunk)

    def learn_decode(self, ticket: LegTicket, tokens: int) -> None:
        """A decode-step sample of an ended leg that generated `tokens` (legs.py)."""
        s = self.states.get(ticket.backend)
        if s is not None:
            decode_sample(self.learner, ticket, tokens, s.scraped_decoding, s.prefilled_tokens, self.clock())

    # --- request-path feedback ---------------------------------------------------------
    def acquire(self, name: str) -> None:
        s = self.states[name]
        s.inflight += 1
        now = self.clock()
        if s.breaker == BreakerState.OPEN and now - s.opened_at >= self.health.cooldown_s:
            s.breaker = BreakerState.HALF_OPEN
            log.info("backend %s: circuit half-open, one trial request", name)
        if s.breaker == BreakerState.HALF_OPEN:
            s.half_open_trial_taken = True
            s.trial_at = now

    def release(self, name: str) -> None:
        s = self.states[name]
        s.inflight -= 1
        if s.breaker == BreakerState.HALF_OPEN:
            # The trial's verdict (record_success / record_failure) follows if it had one;
            # a trial without one (rejected or cancelled probe) frees the slot.
            s.half_open_trial_taken = False

    def record_success(self, name: str) -> None:
        s = self.states.get(name)
        if s is None:  # removed meanwhile
            return
        s.consecutive_failures = 0
        if s.breaker != BreakerState.CLOSED or not s.healthy:
            log.info("backend %s: healthy again (breaker closed)", name)
        s.breaker = BreakerState.CLOSED
        s.half_open_trial_taken = False
        s.healthy = True

    def record_failure(self, name: str, reason: str) -> None:
        s = self.states.get(name)
        if s is None:  # removed meanwhile
            return
        s.consecutive_failures += 1
        s.last_error = reason
        if s.breaker == BreakerState.HALF_OPEN or (
            s.breaker == BreakerState.CLOSED and s.consecutive_failures >= self.health.failure_threshold
        ):
            log.warning("backend %s: circuit opened after %d failures (%s)", name, s.consecutive_failures, reason)
            s.breaker = BreakerState.OPEN
            s.opened_at = self.clock()
            s.half_open_trial_taken = False

    # --- scraper feedback ----------------------------------------------------------------
    def record_scrape(
        self,
        name: str,
        load: dict[str, float],
        models: tuple[str, ...] | None,
        adapters: tuple[str, ...] | None = None,
        legs_closed_before: int | None = None,
    ) -> None:
        """One scrape's figures; `legs_closed_before`: `BackendState.legs_closed` when its
        read began (None: the scrape is as old as the router's counts)."""
        s = self.states.get(name)
        if s is None:  # removed meanwhile
            return
        s.check_failures = 0
        s.running = load.get(RUNNING, 0.0)
        s.waiting = load.get(WAITING, 0.0)
        # What the engine holds beyond this router's legs now is other replicas' traffic.
        ended = 0 if legs_closed_before is None else max(s.legs_closed - legs_closed_before, 0)
        s.others.observe(s.running, s.waiting, s.prefilling, s.decoding + ended, self.clock())
        s.kv_usage = load.get(KV_USAGE, 0.0)
        if HITS_DEVICE in load:
            self.learner.observe_cache_tiers(
                name, load[HITS_DEVICE], load.get(HITS_HOST, 0.0), load.get(OFFLOAD_LOAD_TIME, 0.0)
            )
        s.last_scrape_ok = self.clock()
        if models is not None and not s.config.models and models != s.models:
            if s.models:
                log.info("backend %s: now serves %s", name, ", ".join(models))
            s.models = models
        if adapters is not None:
            s.adapters = adapters
        if not s.healthy:
            log.info(
                "backend %s: answers its health checks again%s",
                name,
                "" if s.breaker == BreakerState.CLOSED else f" (circuit {s.breaker} until a trial request succeeds)",
            )
        # Healthy, but the breaker is left alone: only requests close it.
        s.healthy = True

    def record_scrape_failure(self, name: str, reason: str, definitive: bool = True) -> None:
        """A failed health check. Definitive failures (connection refused: nothing
        listens) mark the backend down at once; ambiguous ones (a timeout, which a loaded
        machine produces too) only after `failure_threshold` in a row."""
        s = self.states.get(name)
        if s is None:  # removed meanwhile
            return
        s.check_failures += 1
        if definitive or s.check_failures >= self.health.failure_threshold:
            if s.healthy:
                log.warning("backend %s: unreachable (%s), skipped until it answers", name, reason)
            s.healthy = False
        s.last_error = reason
