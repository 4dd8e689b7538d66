"""What a planner may know: a read-only snapshot of the backends at one instant.

The registry (router/fleet/registry.py) owns the mutable facts; every plan is made over a
`ClusterSnapshot` of `BackendView`s, so routing policies are pure functions, testable
without sockets, and a plan never sees a backend change under it.
"""

from __future__ import annotations

from dataclasses import field

from router.readonly import readonly
from router.routing.costmodel import EngineSpeed, ItlSpeed, TransferSpeed


@readonly
class BackendView:
    """What a planner may know about one backend at one instant."""

    name: str
    url: str
    decodes: bool
    prefills: bool
    models: tuple[str, ...]
    available: bool  # healthy and breaker not open (half-open counts: it takes a trial)
    inflight: int  # requests the router has open on it now
    running: float  # scraped vllm:num_requests_running
    waiting: float  # scraped vllm:num_requests_waiting
    kv_usage: float  # scraped vllm:kv_cache_usage_perc, 0..1
    drained: bool = False  # taken out of rotation by an operator (never routed to)
    # Prompt tokens still to prefill ahead of a request sent now (router/routing/costmodel.py).
    queued_tokens: float = 0.0
    decoding: float = 0.0  # sequences generating
    prefilling: int = 0  # this router's legs there without a first token yet
    speed: EngineSpeed = field(default_factory=EngineSpeed)
    # False: a stock engine without the threshold plugin, never probed (router/fleet/capability.py).
    threshold_capable: bool = True
    # The router's index of the engine's KV blocks (router/routing/kv_index.py) follows its
    # event stream closely: in sync, not behind, not silent while the engine works
    # (router/fleet/kv_events.py). False: no stream, or its entries are not to be trusted now.
    kv_events_fresh: bool = False
    # When a block last left that index (removed, cleared; monotonic clock, 0.0: never): a
    # prompt the router placed there after it is still held.
    kv_removed_at: float = 0.0
    # The engine served traffic this router did not send within the last minute (other
    # replicas): what this router remembers sending it is not all it holds.
    others_seen: bool = False
    # The LoRA adapters among `models` (vLLM lists them with a `parent`; loaded through the
    # router): an adapter is served only where it is listed, never by an engine whose
    # models are unknown.
    adapters: tuple[str, ...] = ()
    # Its measured decode step: the gap between tokens of its decoding sequences (costmodel.py).
    itl: ItlSpeed = field(default_factory=ItlSpeed)
    # Of `decoding`, the sequences a stalling prefill has pushed past the ITL SLO already
    # (router/fleet/legs.py EngineLegs): another stall costs them nothing more.
    stalled: float = 0.0
    # Splits decoding here whose KV is on its way: seconds until each one's TTFT SLO runs out.
    # A prefill sent here now runs ahead of their decode legs (router/routing/goodput.py).
    kv_awaited_s: tuple[float, ...] = ()
    # When this router's oldest leg there still without a first token was sent (monotonic
    # clock; inf: none): a prompt sent there since may still be computing, so the engine's
    # rejection cannot report it yet (router/dispatch/placement.py `fallback_after_race`).
    prefilling_since: float = float("inf")
    # Its prefill chunk (vLLM's max_num_batched_tokens): a prefill's stall of each step.
    chunk_tokens: float = 8192.0

    @property
    def load(self) -> float:
        """One interpretable load figure: requests queued or running on the engine,
        as the router sees them (its own in-flight) or as the engine reports them,
        whichever is larger (scrapes lag; in-flight misses other routers' traffic)."""
        return max(float(self.inflight), self.running + self.waiting)

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models


@readonly
class ClusterSnapshot:
    backends: tuple[BackendView, ...]
    # Learned cluster-wide figures the cost model reads (router/routing/speed_learner.py).
    transfer: TransferSpeed = field(default_factory=TransferSpeed)
    chars_per_token: float = 4.0
    race_wait_s: float = 0.005  # what waiting for the verdicts of a race nobody won costs
    race_saving_share: float = 0.5  # share of a prompt's prefill time races have been saving
    race_saving_share_unplaced: float = 0.5  # the same for prompts the memory places nowhere
    # Every LoRA adapter some engine holds: a request naming one goes only where it is listed.
    adapters: frozenset[str] = frozenset()
    # Prompt tokens per second this router asked its engines to prefill lately (router/fleet/decayed_rate.py).
    prompt_tokens_per_s: float = 0.0

    def serves(self, b: BackendView, model: str | None) -> bool:
        """Does `b` serve `model`? An adapter only where it is listed; a base model also
        where the engine's models are not known yet."""
        if model is not None and model in self.adapters:
            return model in b.models
        return b.serves(model)

    def decoders(self, model: str | None) -> list[BackendView]:
        """Available decode backends for `model`. If none is available, every decode
        backend for the model (panic routing, as Envoy does below its panic threshold): a
        health view that says "nothing works" is more often wrong (checks timing out under
        load) than right, and a real attempt fails fast with a precise error anyway. A
        drained backend is never among them: an operator took it out on purpose."""
        serving = [b for b in self.backends if b.decodes and self.serves(b, model) and not b.drained]
        return [b for b in serving if b.available] or serving

    def prefillers(self, model: str | None) -> list[BackendView]:
        return [b for b in self.backends if b.available and b.prefills and self.serves(b, model)]

    def get(self, name: str) -> BackendView | None:
        for b in self.backends:
            if b.name == name:
                return b
        return None
