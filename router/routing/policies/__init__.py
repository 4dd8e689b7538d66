"""The routing policies' registry: every `routing.strategy` name and the planner it makes,
the one list that config validation and `make_strategy` read.

A policy is a class with a `name` (a `StrategyName`), a `validate(routing)` that names
the problems of the routing keys it reads, and the `Strategy` interface of
router/routing/planning.py (`plan`, `on_routed`, `expected_hits`); one module each.
"""

from __future__ import annotations

from router.config.schema import ConfigError, RoutingConfig
from router.names import StrategyName
from router.routing.planning import Policy, Strategy
from router.routing.policies.least_loaded import LeastLoadedStrategy
from router.routing.policies.prefix_tree import PrefixTreeStrategy
from router.routing.policies.probe import ProbeStrategy
from router.routing.policies.round_robin import RoundRobinStrategy

POLICIES: dict[StrategyName, Policy] = {
    policy.name: policy for policy in (ProbeStrategy, RoundRobinStrategy, LeastLoadedStrategy, PrefixTreeStrategy)
}

__all__ = [
    "POLICIES",
    "LeastLoadedStrategy",
    "PrefixTreeStrategy",
    "ProbeStrategy",
    "RoundRobinStrategy",
    "check",
    "make_strategy",
]


def problems(routing: RoutingConfig) -> list[str]:
    """Every policy's problems with the keys it reads, not only the chosen one's: a reload
    or CACHEHIT_ROUTER_STRATEGY may switch the strategy, and a file valid for one is then
    valid for all. Each names its key."""
    found: list[str] = []
    if routing.strategy not in POLICIES:
        found.append(f"routing.strategy: expected one of {', '.join(POLICIES)}, got {routing.strategy!r}")
    for policy in POLICIES.values():
        found.extend(p for p in policy.validate(routing) if p not in found)  # two may read one key
    return found


def check(routing: RoutingConfig) -> None:
    """A ConfigError naming every key a policy finds wrong (router.toml is loaded, then this)."""
    found = problems(routing)
    if found:
        raise ConfigError(*found)


def make_strategy(routing: RoutingConfig) -> Strategy:
    """A fresh planner for `routing.strategy`; a ConfigError if a policy's keys are wrong."""
    check(routing)
    return POLICIES[routing.strategy](routing)
