"""`least_loaded`: the least predicted time to first token with every engine computing the
whole prompt (load-aware, cache-blind: the cost model's baseline).

Engines whose predictions differ by less than the model can resolve are tied, and ties
go by the prompt's opening, not by chance: at low load every engine is predicted alike,
and a tie broken by the request (or by the engines' scraped KV usage, which is highest
on the engine that just served a prompt: the one holding it) scattered each repeated
prompt over every engine, so a cache-blind policy got fewer hits than round robin. The
rule among tied engines is consistent hashing with bounded loads (Mirrokni, Thorup and
Zadimoghaddam, 2018): the rendezvous-hash winner of the prompt's opening among the tied
engines whose load is within `LOAD_BOUND` of the mean, so a repeated prompt goes where it
went while load does not tell engines apart, and distinct prompts spread evenly.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

from router.config.checks import Problems
from router.config.schema import RoutingConfig
from router.routing.planning import NoSettings, Plan, RouteQuery, chosen_plan, decoders_for, predicted_ttft
from router.routing.snapshot import BackendView, ClusterSnapshot

# Predictions closer than this are not told apart: the typical scatter of an observed
# time to first token around the model (online_fit.NOISE_S), or a share of the
# prompt's own prefill on an idle engine (engines of one fleet fitted apart differ by a
# few percent by noise alone). A share of the prompt's own time, not of the queue ahead:
# keeping a prompt where it went may cost it at most that much, whatever the load.
TIE_S = 0.005
TIE_SHARE = 0.05
# A tied engine takes the prompt only while its load stays within this factor of the
# fleet's mean load counting the request (the bound of the paper above; HAProxy's
# default hash-balance-factor is 125).
LOAD_BOUND = 1.25
# The opening that names a prompt for the hash: about 256 tokens, a system prompt's or a
# conversation's first turn's worth, shared by the requests that repeat it.
OPENING_CHARS = 1024


def tie_tolerance_s(own_s: float) -> float:
    """How much slower than the best prediction an engine may be predicted and still tie,
    for a prompt whose prefill on an idle engine is predicted to take `own_s`."""
    return max(TIE_S, TIE_SHARE * own_s)


def affinity_rank(opening: str, engine: str) -> bytes:
    """The rendezvous-hash weight of `engine` for a prompt opening with `opening`: the same
    in every router process (a replica picks what its peers pick)."""
    return hashlib.blake2b(f"{engine}\0{opening}".encode(), digest_size=8).digest()


def tied_choice(query: RouteQuery, candidates: Sequence[BackendView], costs: Sequence[float], own_s: float) -> int:
    """Index of the engine to send to: the least predicted time, or among the engines tied
    with it and not past the load bound, the prompt opening's rendezvous-hash winner."""
    best = min(costs)
    tolerance = tie_tolerance_s(own_s)
    tied = [i for i, c in enumerate(costs) if c - best <= tolerance]
    if len(tied) > 1:
        # Each engine's capacity: ceil(bound x mean load with the request), as in the paper.
        capacity = math.ceil(LOAD_BOUND * (sum(b.load for b in candidates) + 1.0) / len(candidates))
        bounded = [i for i in tied if candidates[i].load + 1.0 <= capacity]
        tied = bounded or tied
    if len(tied) == 1:
        return tied[0]
    opening = query.text[:OPENING_CHARS]
    return max(tied, key=lambda i: affinity_rank(opening, candidates[i].name))


class LeastLoadedStrategy:
    """The least predicted time to first token, blind to the cache (every engine is
    assumed to compute the whole prompt): load-aware only, the baseline of the cost model.
    Ties go to the engine the prompt's opening hashes to (module docstring)."""

    name = "least_loaded"
    Settings = NoSettings
    reads_index = False

    def __init__(self, routing: RoutingConfig, settings: NoSettings | None = None):
        pass

    @staticmethod
    def check(settings: NoSettings, problems: Problems) -> None:
        pass  # reads no routing keys of its own

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = decoders_for(query, snap, exclude)
        if not decoders:
            return Plan()
        n = query.tokens(snap)
        costs = [predicted_ttft(b, n, n) for b in decoders]
        own_s = min(b.speed.ttft(n, 0.0) for b in decoders)
        chosen = tied_choice(query, decoders, costs, own_s)
        return chosen_plan(decoders, costs, chosen, round(n), tie_tolerance_s(own_s))

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        pass

    def expected_hits(
        self, query: RouteQuery, prompt_tokens: float, sent_since: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        return {}


POLICY = LeastLoadedStrategy
