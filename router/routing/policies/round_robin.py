"""`round_robin`: each request to the next decode backend in turn, blind to load and cache
(a baseline).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from router.config.checks import Problems
from router.config.schema import RoutingConfig
from router.routing.planning import NoSettings, Plan, RouteQuery, decoders_for, predicted_ttft
from router.routing.snapshot import ClusterSnapshot


class RoundRobinStrategy:
    """Each request to the next decode backend in turn: blind to load and cache."""

    name = "round_robin"
    Settings = NoSettings
    reads_index = False

    def __init__(self, routing: RoutingConfig, settings: NoSettings | None = None):
        self._counter = itertools.count()

    @staticmethod
    def check(settings: NoSettings, problems: Problems) -> None:
        pass  # reads no routing keys of its own

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = decoders_for(query, snap, exclude)
        if not decoders:
            return Plan()
        b = decoders[next(self._counter) % len(decoders)]
        n = query.tokens(snap)
        return Plan(direct=b.name, prefill_tokens=round(n), predicted_ttft_s=predicted_ttft(b, n))

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        pass

    def expected_hits(
        self, query: RouteQuery, prompt_tokens: float, sent_since: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        return {}


POLICY = RoundRobinStrategy
