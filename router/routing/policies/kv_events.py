"""`kv_events`: route on the exact index the engines' own KV-cache events feed, weighed by
load through the one cost model: the precise baseline, as the leading routers do it.

llm-d's precise prefix-cache scorer and NVIDIA Dynamo's KV router subscribe to vLLM's
event stream (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`), keep a block index per
engine and score each engine by the prompt blocks it already holds against its load.
Dynamo's cost is `overlap_weight * blocks to prefill + blocks decoding` (lower is better);
llm-d's is a weighted sum of the longest cached prefix and queue and KV-usage scorers.
Here the same trade is the router's one cost model (router/routing/costmodel.py):

    ttft(engine) = a + b * (queued_tokens + prompt - indexed_hit) + h * indexed_hit + c * decoding

where `indexed_hit` is what the index says the engine holds of this prompt (GPU and CPU
tier; a CPU-tier token costs `h`, its load). The engine with the least predicted time to
first token gets the request; nothing is asked of the engines. An engine the index does
not speak for (no event stream, a stream behind or silent, a router just started) counts
as holding nothing: the baseline trusts its index alone, which is what the probe policy is
measured against where events cannot keep up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from router.config.checks import Problems
from router.config.schema import RoutingConfig
from router.names import RaceReason
from router.routing.planning import NoSettings, Plan, RouteQuery, decoders_for, direct_plan
from router.routing.snapshot import ClusterSnapshot


class KvEventsStrategy:
    """The least predicted time to first token, each engine lacking the prompt minus what
    its KV events say it holds."""

    name = "kv_events"
    Settings = NoSettings
    # The dispatcher matches the prompt's engine token ids against the index for it.
    reads_index = True

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
        return replace(
            direct_plan(query, snap, decoders, self.expected_hits(query, n)), race_reason=RaceReason.NOT_RACING
        )

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        pass  # the engine's own events say what it now holds

    def expected_hits(
        self, query: RouteQuery, prompt_tokens: float, sent_since: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        # Nothing is known to be in flight: the baseline reads the index alone.
        if sent_since is not None or not query.indexed:
            return {}
        return {name: min(tokens, prompt_tokens) for name, tokens in query.indexed.items()}


POLICY = KvEventsStrategy
