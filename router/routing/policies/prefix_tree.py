"""`prefix_tree`: prefix affinity from the router's own memory of where it sent prompts,
weighed by load through the cost model.
"""

from __future__ import annotations

from router.config.checks import Problems
from router.config.schema import RoutingConfig
from router.routing.planning import NoSettings, Plan, RemembersPrefixes, RouteQuery, decoders_for, direct_plan
from router.routing.prefix_memory import PrefixMemory
from router.routing.snapshot import ClusterSnapshot


class PrefixTreeStrategy(RemembersPrefixes):
    """Prefix affinity weighed by load, as a router-side index does it (SGLang's and
    vllm-router's cache_aware, Dynamo's KV router): the least predicted time to first
    token, where each engine lacks the prompt minus what the prefix memory says the router
    sent it. Its load bound is the cost model itself: an engine holding the prefix wins
    unless another computes the whole prompt sooner than it works through its queue."""

    name = "prefix_tree"
    Settings = NoSettings
    reads_index = False

    def __init__(self, routing: RoutingConfig, settings: NoSettings | None = None, memory: PrefixMemory | None = None):
        self.memory = memory or PrefixMemory(max_bytes=routing.prefix_memory_bytes)

    @staticmethod
    def check(settings: NoSettings, problems: Problems) -> None:
        pass  # reads no routing keys of its own

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = decoders_for(query, snap, exclude)
        if not decoders:
            return Plan()
        return direct_plan(query, snap, decoders, self.expected_hits(query, query.tokens(snap)))


POLICY = PrefixTreeStrategy
