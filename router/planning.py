"""Routing strategies: pure planners over a `ClusterSnapshot`, all reading one cost model.

A strategy answers one question, `plan(query, snapshot, exclude) -> Plan`: which backends
to probe with which cache-hit threshold, or which single backend to send the request to.
The fallback after a race that found no cache is router/fallback.py. Nothing here does
I/O, so every policy is unit-tested with plain data. Strategies may keep small state that
a feedback hook (`on_routed`, as in Ray Serve's request router) updates: the round-robin
counter and the prefix memory of where prompts went.

Every load- or cache-aware choice is "least predicted time to first token"
(router/costmodel.py: queued prefill tokens, tokens the engine lacks, decoding sequences,
measured speed). Ties rotate with a per-request salt so equal engines share traffic.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Protocol, Sequence

from . import costmodel
from .backends import BackendView, ClusterSnapshot
from .config import RoutingConfig
from .prefix_memory import PrefixMemory

ROUTE_PROBE_HIT = "probe_hit"
ROUTE_PD = "pd"
ROUTE_DIRECT = "direct"

# Of the requests whose race the learned figures call not worth it, one in this many races
# anyway, so that what races are worth keeps being measured as traffic changes.
EXPLORE_ONE_IN = 16

# The race deadline allows an acceptor this many times its predicted time to first token:
# predictions are medians, and an acceptor cut off at the deadline costs a whole fallback.
DEADLINE_MARGIN = 2.0


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """The part of a request a planner may look at."""

    model: str | None
    text: str  # prompt text (chat: rendered messages), for prefix affinity
    salt: int = 0  # spreads ties; e.g. hash of the request id
    prompt_tokens: int | None = None  # exact when the prompt came as token ids

    def tokens(self, snap: ClusterSnapshot) -> float:
        """The prompt's length in tokens: exact, or from the learned characters per token."""
        if self.prompt_tokens is not None:
            return float(self.prompt_tokens)
        return len(self.text) / max(snap.chars_per_token, 0.5)


@dataclass(frozen=True, slots=True)
class Plan:
    """First step for a request: race `probes` at `threshold`, or send to `direct`."""

    probes: tuple[str, ...] = ()
    threshold: float = 0.0
    deadline_s: float = 0.0
    # Added to the deadline per prompt token once the prompt's length is known.
    deadline_per_prompt_token_s: float = 0.0
    direct: str | None = None
    # Cost-model figures of the choice: prompt tokens the chosen engine is expected to
    # prefill (its queue grows by that until the first token) and the predicted seconds
    # to first token, per probe when racing.
    prefill_tokens: int = 0
    predicted_ttft_s: float | None = None
    probe_ttft_s: tuple[float, ...] = ()
    # The race's alternative: where the request would have gone without it.
    cold: str | None = None
    cold_ttft_s: float | None = None
    scratch_ttft_s: float | None = None  # the best engine computing the whole prompt
    # The race was skipped: the prompt is computed where the fallback's cost model says,
    # which may be a prefill/decode split (router/fallback.py).
    skipped_race: bool = False
    # The prefix memory expected the prompt on some engine (what a race is worth is
    # measured apart for prompts it places and prompts it does not).
    placed: bool = True

    @property
    def empty(self) -> bool:
        return not self.probes and self.direct is None


def predicted_ttft(b: BackendView, lacking: float, prompt_tokens: float | None = None) -> float:
    """The cost model on one backend as the snapshot sees it; with `prompt_tokens`, the
    tokens it holds (prompt - lacking) cost what loading them from its CPU tier costs."""
    held = 0.0 if prompt_tokens is None else max(prompt_tokens - max(lacking, 0.0), 0.0)
    return costmodel.ttft(b.speed, b.queued_tokens, b.decoding, lacking, held)


def fastest(candidates: Sequence[BackendView], lacking: Callable[[BackendView], float],
            salt: int = 0, prompt_tokens: float | None = None) -> tuple[BackendView, float]:
    """The backend with the least predicted time to first token, and that time; equal
    predictions rotate with `salt` (KV usage breaks ties first: more room, fewer preemptions)."""
    n = len(candidates)
    costs = [predicted_ttft(b, lacking(b), prompt_tokens) for b in candidates]
    best = min(range(n), key=lambda i: (costs[i], candidates[i].kv_usage, (i - salt) % n))
    return candidates[best], costs[best]


class Strategy(Protocol):
    name: str

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        ...

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        """Feedback: `backend` served `query` (winner, fallback decode, or direct)."""
        ...

    def expected_hits(self, query: RouteQuery, prompt_tokens: float,
                      sent_within_s: float | None = None) -> dict[str, float]:
        """Prompt tokens each backend is expected to hold (with `sent_within_s`: because
        the router sent it the prompt that recently, so it may still be computing it)."""
        ...


def decoders_for(query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str]) -> list[BackendView]:
    return [b for b in snap.decoders(query.model) if b.name not in exclude]


def _direct(query: RouteQuery, snap: ClusterSnapshot, candidates: Sequence[BackendView],
            hits: Mapping[str, float]) -> Plan:
    n = query.tokens(snap)
    best, seconds = fastest(candidates, lambda b: n - hits.get(b.name, 0.0), query.salt, n)
    return Plan(direct=best.name, prefill_tokens=round(max(n - hits.get(best.name, 0.0), 0.0)),
                predicted_ttft_s=seconds)


class ProbeStrategy:
    """Ask the engines: probe the decode backends at threshold T.

    Which ones, from the cost model: an engine that accepts holds at least T of the prompt
    (or what the prefix memory expects it to hold, if more), so its predicted time to first
    token as an acceptor is ttft(queue, prompt - max(T * prompt, expected hit)). It is probed
    only if that is no later than the best engine computing the whole prompt: an acceptor
    slower than that can only make the request wait. (The bound leaves the memory out: it
    may be stale, and an engine it wrongly favours must not keep the others from being
    asked.) With `max_probes` the qualifying engines are ranked by that prediction; with
    `max_probe_waiting` engines with a longer scraped queue are skipped.

    Whether to race at all: a race is worth what the engines know that the router does not
    (a prefix another replica sent, an eviction the memory missed, a CPU-tier copy). The
    router measures it (`race_value`): the share of the prompt's prefill time that racing
    saved over the cold choice. The request races if that share of its prefill time on the
    cold choice is more than what waiting for verdicts has cost (`race_wait_s`); otherwise it
    goes straight to the cold choice, as does one whose prompt is too short for any hit to
    beat the wait. One in `EXPLORE_ONE_IN` of the skipped requests races anyway, so the
    measurement follows the traffic.

    The prefix memory (`on_routed`) also serves the fallback: an engine still computing a
    cold prompt rejects a follower sharing its prefix (the blocks are not cached yet), so
    `expected_hits` adds what the engines will hold to what they said they hold.
    """

    name = "probe"

    def __init__(self, routing: RoutingConfig, memory: PrefixMemory | None = None):
        self.routing = routing
        self.memory = memory or PrefixMemory()

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = decoders_for(query, snap, exclude)
        if not decoders:
            return Plan()
        # Engines without the threshold would accept every probe: never probed, only sent
        # to directly when no engine can be probed, or as a fallback.
        n = query.tokens(snap)
        hits = self.expected_hits(query, n)
        capable = [b for b in decoders if b.threshold_capable]
        if not capable:
            return _direct(query, snap, decoders, hits)
        decoders = capable
        bound = self.routing.max_probe_waiting
        if bound:
            decoders = [b for b in decoders if b.waiting <= bound] or decoders
        cold = _direct(query, snap, decoders, hits)
        assert cold.predicted_ttft_s is not None and cold.direct is not None
        best = snap.get(cold.direct)
        # What the memory expects is a guess (engines evict; other replicas route too), so
        # the most a race can save is the whole prompt's prefill on the cold choice.
        placed = any(v > 0.0 for v in hits.values())
        skip = replace(cold, skipped_race=True, placed=placed)
        most = 0.0 if best is None else costmodel.hit_saving_s(best.speed, n)
        if self.routing.race == "auto":
            if most <= snap.race_wait_s:
                return skip
            share = snap.race_saving_share if placed else snap.race_saving_share_unplaced
            if share * most <= snap.race_wait_s and query.salt % EXPLORE_ONE_IN:
                return skip
        t = self.routing.cache_hit_threshold
        _, from_scratch = fastest(decoders, lambda b: n, query.salt)
        as_acceptor = [(predicted_ttft(b, n - max(t * n, hits.get(b.name, 0.0)), n), b) for b in decoders]
        worth = [(s, b) for s, b in as_acceptor if s <= from_scratch]
        if not worth:
            return skip
        limit = self.routing.max_probes
        if limit and len(worth) > limit:
            k = len(decoders)
            order = {b.name: i for i, b in enumerate(decoders)}
            worth.sort(key=lambda sb: (sb[0], (order[sb[1].name] - query.salt) % k))
            worth = worth[:limit]
        # Deadline: the slowest probed engine's predicted time as an acceptor, with margin,
        # on top of the configured floor; it grows with the prompt once a rejection says
        # how long the prompt is (the estimate from characters may be short).
        slowest = max(b.speed.per_token_s for _, b in worth)
        return Plan(probes=tuple(b.name for _, b in worth), threshold=t,
                    deadline_s=self.routing.probe_deadline_ms / 1000.0 + DEADLINE_MARGIN * max(s for s, _ in worth),
                    deadline_per_prompt_token_s=DEADLINE_MARGIN * (1.0 - t) * max(slowest, costmodel.MIN_PER_TOKEN_S),
                    probe_ttft_s=tuple(s for s, _ in worth), cold=cold.direct,
                    cold_ttft_s=cold.predicted_ttft_s, scratch_ttft_s=from_scratch, placed=placed)

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        self.memory.insert(self.memory.chunk_hashes(query.text), backend)

    def expected_hits(self, query: RouteQuery, prompt_tokens: float,
                      sent_within_s: float | None = None) -> dict[str, float]:
        return self.memory.expected_hits(query.text, prompt_tokens, sent_within_s)


class RoundRobinStrategy:
    """Each request to the next decode backend in turn: blind to load and cache."""

    name = "round_robin"

    def __init__(self, routing: RoutingConfig):
        self._counter = itertools.count()

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = decoders_for(query, snap, exclude)
        if not decoders:
            return Plan()
        b = decoders[next(self._counter) % len(decoders)]
        n = query.tokens(snap)
        return Plan(direct=b.name, prefill_tokens=round(n), predicted_ttft_s=predicted_ttft(b, n))

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        pass

    def expected_hits(self, query: RouteQuery, prompt_tokens: float,
                      sent_within_s: float | None = None) -> dict[str, float]:
        return {}


class LeastLoadedStrategy:
    """The least predicted time to first token, blind to the cache (every engine is
    assumed to compute the whole prompt): load-aware only, the baseline of the cost model."""

    name = "least_loaded"

    def __init__(self, routing: RoutingConfig):
        pass

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = decoders_for(query, snap, exclude)
        if not decoders:
            return Plan()
        return _direct(query, snap, decoders, {})

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        pass

    def expected_hits(self, query: RouteQuery, prompt_tokens: float,
                      sent_within_s: float | None = None) -> dict[str, float]:
        return {}


class PrefixTreeStrategy:
    """Prefix affinity weighed by load, as a router-side index does it (SGLang's and
    vllm-router's cache_aware, Dynamo's KV router): the least predicted time to first
    token, where each engine lacks the prompt minus what the prefix memory says the router
    sent it. Its load bound is the cost model itself: an engine holding the prefix wins
    unless another computes the whole prompt sooner than it works through its queue."""

    name = "prefix_tree"

    def __init__(self, routing: RoutingConfig, memory: PrefixMemory | None = None):
        self.memory = memory or PrefixMemory()

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = decoders_for(query, snap, exclude)
        if not decoders:
            return Plan()
        return _direct(query, snap, decoders, self.expected_hits(query, query.tokens(snap)))

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        self.memory.insert(self.memory.chunk_hashes(query.text), backend)

    def expected_hits(self, query: RouteQuery, prompt_tokens: float,
                      sent_within_s: float | None = None) -> dict[str, float]:
        return self.memory.expected_hits(query.text, prompt_tokens, sent_within_s)


def race_value(plan: Plan, snap: ClusterSnapshot, prompt_tokens: float, expected: Mapping[str, float],
               winner: str | None, chosen_ttft_s: float | None, reported: Mapping[str, float]) -> float:
    """What a finished race was worth, as a share of the prompt's prefill time on the cold
    choice: how much sooner its outcome is predicted to deliver the first token than the
    cold choice would have, judged with what the engines reported (the truth) where they
    reported. A winner other than the cold choice saved the difference between the cold
    choice and the winner as an acceptor; the cold choice winning saved nothing."""
    cold = snap.get(plan.cold) if plan.cold else None
    if cold is None or prompt_tokens <= 0:
        return 0.0
    held = reported.get(cold.name, expected.get(cold.name, 0.0))
    cold_s = predicted_ttft(cold, prompt_tokens - held, prompt_tokens)
    if winner is not None:
        if winner == cold.name:
            return 0.0
        chosen_ttft_s = dict(zip(plan.probes, plan.probe_ttft_s)).get(winner)
    if chosen_ttft_s is None:
        return 0.0
    return max(cold_s - chosen_ttft_s, 0.0) / costmodel.hit_saving_s(cold.speed, prompt_tokens)


STRATEGY_CLASSES = {
    "probe": ProbeStrategy,
    "round_robin": RoundRobinStrategy,
    "least_loaded": LeastLoadedStrategy,
    "prefix_tree": PrefixTreeStrategy,
}


def make_strategy(routing: RoutingConfig) -> Strategy:
    return STRATEGY_CLASSES[routing.strategy](routing)
