"""What every routing strategy shares: the query, the plan, the `Strategy` interface and
the cost-model helpers the planners in router/routing/policies/ are built from.

A strategy answers one question, `plan(query, snapshot, exclude) -> Plan`: which backends
to probe with which cache-hit threshold, or which single backend to send the request to.
The fallback after a race that found no cache is router/routing/fallback.py. Nothing here does
I/O, so every policy is unit-tested with plain data. Strategies may keep small state that
a feedback hook (`on_routed`, as in Ray Serve's request router) updates: the round-robin
counter and the prefix memory of where prompts went.

Every load- or cache-aware choice is "least predicted time to first token"
(router/routing/costmodel.py: queued prefill tokens, tokens the engine lacks, decoding sequences,
measured speed). Ties rotate with a per-request salt so equal engines share traffic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from router.config.checks import Problems
from router.config.schema import RoutingConfig
from router.readonly import readonly
from router.routing import costmodel
from router.routing.adapter_memory import AdapterMemories
from router.routing.prefix_memory import PrefixMemory
from router.routing.snapshot import BackendView, ClusterSnapshot


@readonly
class RouteQuery:
    """The part of a request a planner may look at."""

    model: str | None
    text: str  # prompt text (chat: rendered messages), for prefix affinity
    salt: int = 0  # spreads ties; e.g. hash of the request id
    prompt_tokens: int | None = None  # exact when the prompt's token ids are known
    token_ids: tuple[int, ...] | None = None  # the engine's token ids, when known
    # What the KV-event index says each engine holds of this prompt (both tiers, in
    # tokens), for the engines whose index is fresh now (router/routing/kv_index.py; filled
    # by router/dispatch/prompt_index.py). An engine absent is unknown, not empty; None: the
    # prompt was not matched against the index.
    indexed: Mapping[str, float] | None = None
    tenant: str = ""  # whose request: the prefix memory shares its budget fairly between tenants
    # The LoRA adapter the request names (None: the base model): engines cache an adapter's
    # prompts apart from the base model's (vLLM hashes the adapter into its blocks), and so
    # does the router's memory of where it sent them.
    adapter: str | None = None

    def tokens(self, snap: ClusterSnapshot) -> float:
        """The prompt's length in tokens: exact, or from the learned characters per token."""
        if self.prompt_tokens is not None:
            return float(self.prompt_tokens)
        return len(self.text) / max(snap.chars_per_token, 0.5)

    def known_hits(self, engine: str, lacking: int) -> tuple[int, int] | None:
        """(lacking, held) prompt tokens on `engine`, where they are known exactly: the prompt
        tokenized, the engine's index fresh, and a plan that counted `lacking` from it (not
        more held, as for a prompt the engine may still be computing)."""
        if self.token_ids is None or self.indexed is None or engine not in self.indexed:
            return None
        held = round(self.indexed[engine])
        return (lacking, held) if len(self.token_ids) - held == lacking else None


@readonly
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
    # which may be a prefill/decode split (router/routing/fallback.py).
    skipped_race: bool = False
    # The prefix memory expected the prompt on some engine (what a race is worth is
    # measured apart for prompts it places and prompts it does not).
    placed: bool = True
    # Why the request races or not (a RaceReason), for the log line and the metric.
    race_reason: str = ""
    # The direct choice's runner-up and its predicted seconds, for the log line; `tied`:
    # the model could not tell it from the choice (the tie rule chose).
    runner_up: str | None = None
    runner_up_ttft_s: float | None = None
    tied: bool = False

    @property
    def empty(self) -> bool:
        return not self.probes and self.direct is None


def predicted_ttft(b: BackendView, lacking: float, prompt_tokens: float | None = None) -> float:
    """The cost model on one backend as the snapshot sees it; with `prompt_tokens`, the
    tokens it holds (prompt - lacking) cost what loading them from its CPU tier costs."""
    held = 0.0 if prompt_tokens is None else max(prompt_tokens - max(lacking, 0.0), 0.0)
    return costmodel.ttft(b.speed, b.queued_tokens, b.decoding, lacking, held)


def ranked(
    candidates: Sequence[BackendView],
    lacking: Callable[[BackendView], float],
    salt: int = 0,
    prompt_tokens: float | None = None,
) -> tuple[int, list[float]]:
    """Index of the backend with the least predicted time to first token, and every
    backend's prediction; equal predictions rotate with `salt` (KV usage breaks ties first:
    more room, fewer preemptions)."""
    n = len(candidates)
    costs = [predicted_ttft(b, lacking(b), prompt_tokens) for b in candidates]
    return min(range(n), key=lambda i: (costs[i], candidates[i].kv_usage, (i - salt) % n)), costs


def fastest(
    candidates: Sequence[BackendView],
    lacking: Callable[[BackendView], float],
    salt: int = 0,
    prompt_tokens: float | None = None,
) -> tuple[BackendView, float]:
    """The backend with the least predicted time to first token, and that time (`ranked`)."""
    best, costs = ranked(candidates, lacking, salt, prompt_tokens)
    return candidates[best], costs[best]


def chosen_plan(
    candidates: Sequence[BackendView],
    costs: Sequence[float],
    chosen: int,
    prefill_tokens: int,
    tolerance_s: float = 0.0,
) -> Plan:
    """The plan sending to `candidates[chosen]`, predicted `costs[chosen]`, with its
    runner-up for the log: the least prediction of the others (none with nobody else), and
    whether it was tied with the choice (within `tolerance_s`: the strategy's tie rule chose)."""
    others = [i for i in range(len(costs)) if i != chosen]
    other = min(others, key=costs.__getitem__) if others else None
    return Plan(
        direct=candidates[chosen].name,
        prefill_tokens=prefill_tokens,
        predicted_ttft_s=costs[chosen],
        runner_up=None if other is None else candidates[other].name,
        runner_up_ttft_s=None if other is None else costs[other],
        tied=other is not None and costs[other] - costs[chosen] <= tolerance_s,
    )


class Strategy(Protocol):
    """A routing policy's planner (router/routing/policies/) and the feedback it learns from."""

    name: str
    # True: the dispatcher matches each prompt against the KV-event index for it
    # (`RouteQuery.indexed`; one /tokenize call per text prompt).
    reads_index: bool

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan: ...

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        """Feedback: `backend` served `query` (winner, fallback decode, or direct)."""
        ...

    def expected_hits(
        self, query: RouteQuery, prompt_tokens: float, sent_since: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """Prompt tokens each backend is expected to hold (with `sent_since`: only where the
        router sent the prompt at or after that engine's time there, so it may still be
        computing it)."""
        ...


@runtime_checkable
class AsksTheIndexWhenUnsure(Protocol):
    """A policy that reads the KV-event index only where it could change the plan
    (router/dispatch/prompt_index.py asks it before matching a prompt: the lookup costs a
    /tokenize round trip for a text prompt)."""

    def wants_index(self, query: RouteQuery, snap: ClusterSnapshot) -> bool: ...


class Policy(Protocol):
    """A policy as the registry holds it (router/routing/policies/): its class, which names
    itself, declares its settings (a frozen dataclass whose fields are its `[routing]` keys,
    with their defaults), checks them, and builds a planner from them."""

    name: str
    Settings: type[Any]
    reads_index: bool

    def __call__(self, routing: RoutingConfig, settings: Any) -> Strategy: ...

    @staticmethod
    def check(settings: Any, problems: Problems) -> None:
        """Record in `problems` each wrong value of `settings`, naming its `routing.` key."""
        ...


@dataclass(frozen=True)
class NoSettings:
    """The settings of a policy that reads no `[routing]` keys of its own."""


class RemembersPrefixes:
    """A planner's feedback when it remembers where it sent prompts (router/routing/prefix_memory.py):
    each routed prompt goes into the memory, whose expectations are the planner's hits. A
    reload that keeps the policy hands the memory on (where prompts went is still true)."""

    memory: PrefixMemory
    # Each LoRA adapter's prompts apart (router/routing/adapter_memory.py); handed on with `memory`.
    adapter_memories: AdapterMemories | None = None

    def memory_for(self, query: RouteQuery) -> PrefixMemory:
        if query.adapter is None:
            return self.memory
        if self.adapter_memories is None:
            self.adapter_memories = AdapterMemories()
        return self.adapter_memories.get(self.memory, query.adapter)

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        memory = self.memory_for(query)
        memory.insert(memory.chunk_hashes(query.text), backend, tenant=query.tenant)

    def expected_hits(
        self, query: RouteQuery, prompt_tokens: float, sent_since: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        return self.memory_for(query).expected_hits(query.text, prompt_tokens, sent_since=sent_since)


def decoders_for(query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str]) -> list[BackendView]:
    return [b for b in snap.decoders(query.model) if b.name not in exclude]


def direct_plan(
    query: RouteQuery, snap: ClusterSnapshot, candidates: Sequence[BackendView], hits: Mapping[str, float]
) -> Plan:
    """Send to the candidate with the least predicted time to first token, each lacking
    the prompt minus its expected hit."""
    n = query.tokens(snap)
    i, costs = ranked(candidates, lambda b: n - hits.get(b.name, 0.0), query.salt, n)
    return chosen_plan(candidates, costs, i, round(max(n - hits.get(candidates[i].name, 0.0), 0.0)))


def race_value(
    plan: Plan,
    snap: ClusterSnapshot,
    prompt_tokens: float,
    expected: Mapping[str, float],
    winner: str | None,
    chosen_ttft_s: float | None,
    reported: Mapping[str, float],
) -> float:
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
        chosen_ttft_s = dict(zip(plan.probes, plan.probe_ttft_s, strict=False)).get(winner)
    if chosen_ttft_s is None:
        return 0.0
    return max(cold_s - chosen_ttft_s, 0.0) / costmodel.hit_saving_s(cold.speed, prompt_tokens)
