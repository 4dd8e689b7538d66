"""Routing strategies: pure planners over a `ClusterSnapshot`.

A strategy answers one question, `plan(query, snapshot, exclude) -> Plan`: which backends
to probe with which cache-hit threshold, or which single backend to send the request to.
`plan_fallback` answers the second: after every probe rejected, which prefill/decode pair
(or which decode backend alone) serves the request. Nothing here does I/O, so every policy
is unit-tested with plain data. Strategies may keep small state that a feedback hook
(`on_routed`, as in Ray Serve's request router) updates: the round-robin counter and the
prefix tree's per-backend memory of routed text.

Load is the single figure `BackendView.load` (requests queued or running on the engine);
ties break on KV-cache usage, then on a per-request salt so equal backends share traffic.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from .backends import BackendView, ClusterSnapshot
from .config import RoutingConfig

ROUTE_PROBE_HIT = "probe_hit"
ROUTE_PD = "pd"
ROUTE_DIRECT = "direct"


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """The part of a request a planner may look at."""

    model: str | None
    text: str  # prompt text (chat: rendered messages), for prefix affinity
    salt: int = 0  # spreads ties; e.g. hash of the request id


@dataclass(frozen=True, slots=True)
class Plan:
    """First step for a request: race `probes` at `threshold`, or send to `direct`."""

    probes: tuple[str, ...] = ()
    threshold: float = 0.0
    deadline_s: float = 0.0
    # Added to the deadline per prompt token once the prompt's length is known.
    deadline_per_prompt_token_s: float = 0.0
    direct: str | None = None

    @property
    def empty(self) -> bool:
        return not self.probes and self.direct is None


@dataclass(frozen=True, slots=True)
class FallbackPlan:
    """After every probe rejected: prefill on `prefill` then decode on `decode`, or
    (prefill None) run directly on `decode`, sending `decode_threshold`."""

    decode: str
    prefill: str | None
    decode_threshold: float

    @property
    def route(self) -> str:
        return ROUTE_PD if self.prefill else ROUTE_DIRECT


def least_loaded(candidates: Sequence[BackendView], salt: int = 0) -> BackendView:
    """The least-loaded backend; ties on load and KV usage rotate with `salt`."""
    n = len(candidates)
    best = min(range(n), key=lambda i: (candidates[i].load, candidates[i].kv_usage, (i - salt) % n))
    return candidates[best]


class Strategy(Protocol):
    name: str

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        ...

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        """Feedback: `backend` served `query` (winner, fallback decode, or direct)."""
        ...


def _decoders(query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str]) -> list[BackendView]:
    return [b for b in snap.decoders(query.model) if b.name not in exclude]


class ProbeStrategy:
    """Ask the engines: probe every available decode backend at threshold T.

    With `max_probe_waiting` set, engines whose scraped waiting queue is longer are not
    probed (they would accept and then make the request wait behind their queue), unless
    that leaves no engine at all. With `max_probes` set, only that many are probed: the
    ones most likely to hold the prompt (see `most_promising`).

    It also remembers where it sent each prompt (`on_routed`, a PrefixMemory): an engine
    still computing a cold prompt rejects a follower sharing its prefix (the blocks are not
    cached yet), so when every probe rejects, `fallback_hits` adds what the engines will
    hold to what they said they hold, and the follower joins its leader.
    """

    name = "probe"

    def __init__(self, routing: RoutingConfig, memory: "PrefixMemory | None" = None):
        self.routing = routing
        self.memory = memory or PrefixMemory()

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = _decoders(query, snap, exclude)
        if not decoders:
            return Plan()
        bound = self.routing.max_probe_waiting
        if bound:
            short = [b for b in decoders if b.waiting <= bound]
            decoders = short or decoders
        limit = self.routing.max_probes
        if limit and len(decoders) > limit:
            decoders = self.most_promising(query, decoders, limit)
        t = self.routing.cache_hit_threshold
        return Plan(probes=tuple(b.name for b in decoders), threshold=t,
                    deadline_s=self.routing.probe_deadline_ms / 1000.0,
                    # An acceptor holds at least T of the prompt: it prefills at most (1 - T).
                    deadline_per_prompt_token_s=(1.0 - t) * self.routing.probe_deadline_per_token_ms / 1000.0)

    def most_promising(self, query: RouteQuery, decoders: Sequence[BackendView],
                       limit: int) -> list[BackendView]:
        """The `limit` decoders most likely to accept: those this router last sent the
        prompt's longest known prefix to, then the least loaded (ties rotate with the
        salt). Memory is per router replica: an engine warmed by another replica is only
        found if load ranks it in, or by the fallback's rejection-reported hits."""
        _, holders = self.memory.match(self.memory.chunk_hashes(query.text))
        n = len(decoders)
        ranked = sorted(range(n), key=lambda i: (decoders[i].name not in holders, decoders[i].load,
                                                 decoders[i].kv_usage, (i - query.salt) % n))
        return [decoders[i] for i in ranked[:limit]]

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        self.memory.insert(self.memory.chunk_hashes(query.text), backend)

    def fallback_hits(self, query: RouteQuery, prompt_tokens: int | None,
                      reported: Mapping[str, int]) -> dict[str, int]:
        """Prompt tokens each engine holds or will hold: the larger of its rejection's
        report and the share of the prompt the router recently sent it."""
        hits = dict(reported)
        if not prompt_tokens:
            return hits
        hashes = self.memory.chunk_hashes(query.text)
        matched, holders = self.memory.match(hashes)
        if matched:
            expected = prompt_tokens * matched // len(hashes)
            for name in holders:
                hits[name] = max(hits.get(name, 0), expected)
        return hits


class RoundRobinStrategy:
    name = "round_robin"

    def __init__(self, routing: RoutingConfig):
        self._counter = itertools.count()

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = _decoders(query, snap, exclude)
        if not decoders:
            return Plan()
        return Plan(direct=decoders[next(self._counter) % len(decoders)].name)

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        pass


class LeastLoadedStrategy:
    name = "least_loaded"

    def __init__(self, routing: RoutingConfig):
        pass

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = _decoders(query, snap, exclude)
        if not decoders:
            return Plan()
        return Plan(direct=least_loaded(decoders, query.salt).name)

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        pass


class PrefixMemory:
    """Which backend was sent which prompt prefixes: an approximate radix tree.

    The SGLang gateway and vllm-router keep a character radix tree per backend. This keeps
    chained hashes of fixed-size text chunks instead (like vLLM's block hashes), which
    gives the same longest-prefix answer at `chunk_chars` granularity at a fraction of the
    cost in Python. Bounded: least recently used (hash, backend) entries are evicted.
    """

    def __init__(self, chunk_chars: int = 64, max_entries: int = 1_000_000):
        self.chunk_chars = chunk_chars
        self.max_entries = max_entries
        self._owners: dict[int, dict[str, None]] = {}
        self._lru: OrderedDict[tuple[int, str], None] = OrderedDict()

    def chunk_hashes(self, text: str) -> list[int]:
        c = self.chunk_chars
        out, h = [], 0
        for i in range(0, len(text) - c + 1, c):
            h = hash((h, text[i:i + c]))
            out.append(h)
        return out

    def match(self, hashes: list[int]) -> tuple[int, set[str]]:
        """Longest matched prefix (in chunks) and the backends holding it."""
        alive: set[str] | None = None
        best_len, best = 0, set()
        for i, h in enumerate(hashes):
            owners = self._owners.get(h)
            if not owners:
                break
            alive = set(owners) if alive is None else alive & owners.keys()
            if not alive:
                break
            best_len, best = i + 1, alive
        return best_len, best

    def insert(self, hashes: list[int], backend: str) -> None:
        for h in hashes:
            self._owners.setdefault(h, {})[backend] = None
            key = (h, backend)
            self._lru[key] = None
            self._lru.move_to_end(key)
        while len(self._lru) > self.max_entries:
            (h, b), _ = self._lru.popitem(last=False)
            owners = self._owners.get(h)
            if owners is not None:
                owners.pop(b, None)
                if not owners:
                    del self._owners[h]


class PrefixTreeStrategy:
    """Approximate prefix affinity, as the SGLang gateway's and vllm-router's cache_aware.

    If load is imbalanced (max - min > 64 and max > 1.5 * min), the least-loaded backend;
    else the backend whose routed text shares the longest prefix with this prompt if that
    covers more than 30% of it; else the least-loaded backend. The choice is remembered.
    """

    name = "prefix_tree"
    balance_abs = 64
    balance_rel = 1.5
    match_threshold = 0.3

    def __init__(self, routing: RoutingConfig, memory: PrefixMemory | None = None):
        self.memory = memory or PrefixMemory()

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = _decoders(query, snap, exclude)
        if not decoders:
            return Plan()
        loads = [b.load for b in decoders]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            return Plan(direct=least_loaded(decoders, query.salt).name)
        hashes = self.memory.chunk_hashes(query.text)
        matched, holders = self.memory.match(hashes)
        if hashes and matched / len(hashes) > self.match_threshold:
            holding = [b for b in decoders if b.name in holders]
            if holding:
                return Plan(direct=least_loaded(holding, query.salt).name)
        return Plan(direct=least_loaded(decoders, query.salt).name)

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        self.memory.insert(self.memory.chunk_hashes(query.text), backend)


STRATEGY_CLASSES = {
    "probe": ProbeStrategy,
    "round_robin": RoundRobinStrategy,
    "least_loaded": LeastLoadedStrategy,
    "prefix_tree": PrefixTreeStrategy,
}


def make_strategy(routing: RoutingConfig) -> Strategy:
    return STRATEGY_CLASSES[routing.strategy](routing)


def fallback_decoder(decoders: Sequence[BackendView], prompt_tokens: int | None,
                     hits: Mapping[str, int], load_tokens: int, salt: int = 0) -> BackendView:
    """The decoder that computes a prompt no engine held enough of: the lowest
    `(prompt_tokens - hit) + load_tokens * load`, where `hit` is what the engine's
    rejection said it holds. Without hits (or a known length) it is the least-loaded one."""
    if not hits or prompt_tokens is None:
        return least_loaded(decoders, salt)
    n = len(decoders)

    def cost(i: int) -> tuple[float, float, int]:
        b = decoders[i]
        lacking = max(prompt_tokens - hits.get(b.name, 0), 0)
        return (lacking + load_tokens * b.load, b.kv_usage, (i - salt) % n)

    return decoders[min(range(n), key=cost)]


def plan_fallback(query: RouteQuery, snap: ClusterSnapshot, routing: RoutingConfig,
                  prompt_tokens: int | None, exclude: frozenset[str] = frozenset(),
                  hits: Mapping[str, int] | None = None) -> FallbackPlan | None:
    """Every probe rejected (or the strategy routes directly and the engine must compute
    the prompt anyway): pick where the prompt is computed.

    The decoder is `fallback_decoder`'s choice (the best mix of partial cache hit, from the
    rejections, and load). Prefill/decode when a prefill backend other than that decoder
    exists, the decoder lacks enough of the prompt to make a KV transfer worth it
    (`min_pd_prompt_tokens`; an unknown length counts as long), and the prefill backend is
    not busier than that decoder (a queue on the prefill engine costs more time than
    computing the prompt where it will be decoded); otherwise directly on that decoder at
    threshold 0.
    """
    decoders = _decoders(query, snap, exclude)
    if not decoders:
        return None
    hits = hits or {}
    decode = fallback_decoder(decoders, prompt_tokens, hits, routing.fallback_load_tokens, query.salt)
    lacking = None if prompt_tokens is None else prompt_tokens - hits.get(decode.name, 0)
    long_enough = lacking is None or lacking >= routing.min_pd_prompt_tokens
    prefillers = [b for b in snap.prefillers(query.model)
                  if b.name != decode.name and b.name not in exclude]
    if prefillers and long_enough:
        prefill = least_loaded(prefillers, query.salt)
        if prefill.load <= decode.load:
            return FallbackPlan(decode=decode.name, prefill=prefill.name,
                                decode_threshold=routing.decode_guard_threshold)
    return FallbackPlan(decode=decode.name, prefill=None, decode_threshold=0.0)
