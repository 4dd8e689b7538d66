"""`least_loaded`: the least predicted time to first token with every engine computing the
whole prompt (load-aware, cache-blind: the cost model's baseline).
"""

from __future__ import annotations

from router.config.checks import Problems
from router.config.schema import RoutingConfig
from router.routing.planning import NoSettings, Plan, RouteQuery, decoders_for, direct_plan
from router.routing.snapshot import ClusterSnapshot


class LeastLoadedStrategy:
    """The least predicted time to first token, blind to the cache (every engine is
    assumed to compute the whole prompt): load-aware only, the baseline of the cost model."""

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
        return direct_plan(query, snap, decoders, {})

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        pass

    def expected_hits(
        self, query: RouteQuery, prompt_tokens: float, sent_within_s: float | None = None
    ) -> dict[str, float]:
        return {}


POLICY = LeastLoadedStrategy
