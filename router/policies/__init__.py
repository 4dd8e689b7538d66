"""The routing policies' registry: every `routing.strategy` name and the planner it makes,
the one list that config validation and `make_strategy` read.

A policy is a class with a `name` (a `StrategyName`), a `validate(routing)` that names
the problems of the routing keys it reads, and the `Strategy` interface of
router/planning.py (`plan`, `on_routed`, `expected_hits`); one module each.
"""

from __future__ import annotations

from ..config import RoutingConfig
from ..names import StrategyName
from ..planning import Policy, Strategy
from .least_loaded import LeastLoadedStrategy
from .prefix_tree import PrefixTreeStrategy
from .probe import ProbeStrategy
from .round_robin import RoundRobinStrategy

POLICIES: dict[StrategyName, Policy] = {
    policy.name: policy for policy in (ProbeStrategy, RoundRobinStrategy, LeastLoadedStrategy, PrefixTreeStrategy)
}

__all__ = [
    "POLICIES",
    "LeastLoadedStrategy",
    "PrefixTreeStrategy",
    "ProbeStrategy",
    "RoundRobinStrategy",
    "make_strategy",
]


def make_strategy(routing: RoutingConfig) -> Strategy:
    """A fresh planner for `routing.strategy` (a validated name)."""
    return POLICIES[routing.strategy](routing)
