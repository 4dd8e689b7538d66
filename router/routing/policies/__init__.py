"""The routing policies' registry: every `routing.strategy` name and the planner it makes.

A policy is one module in this package that defines `POLICY`, a class with
- `name`: its `routing.strategy` value;
- `Settings`: a frozen dataclass whose fields are the `[routing]` keys it reads, with
  their defaults (parsed here from `RoutingConfig.policy_keys`, each named `routing.<key>`);
- `check(settings, problems)`: what else is wrong with them (ranges, choices);
- `__init__(routing, settings)` and the `Strategy` interface of router/routing/planning.py
  (`plan`, `on_routed`, `expected_hits`).
Modules are found by listing the package, so adding a policy touches its module, its
test and the docs (docs/ARCHITECTURE.md, "Adding a policy").
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import fields
from typing import Any

from router.config.checks import Problems, build_table
from router.config.schema import ConfigError, RoutingConfig
from router.routing.planning import Policy, Strategy


def _discover() -> dict[str, Policy]:
    found: dict[str, Policy] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        policy: Policy = importlib.import_module(f"{__name__}.{module}").POLICY
        found[policy.name] = policy
    return found


POLICIES: dict[str, Policy] = _discover()


def _settings(policy: Policy, routing: RoutingConfig, problems: Problems) -> Any:
    own = {f.name for f in fields(policy.Settings)}
    table = {k: v for k, v in routing.policy_keys if k in own}
    settings = build_table(problems, policy.Settings, "routing", table)
    if settings is None:  # only when a required key is missing: policies default every key
        return policy.Settings()
    policy.check(settings, problems)
    return settings


def problems(routing: RoutingConfig) -> list[str]:
    """Every policy's problems with its keys, not only the chosen one's (a reload or
    CACHEHIT_ROUTER_STRATEGY may switch the strategy, and a file valid for one is then valid
    for all), a key no policy reads, and an unknown strategy; each names its key."""
    found = Problems()
    if routing.strategy not in POLICIES:
        found.add(f"routing.strategy: expected one of {', '.join(POLICIES)}, got {routing.strategy!r}")
    known: set[str] = set()
    for policy in POLICIES.values():
        known.update(f.name for f in fields(policy.Settings))
        one = Problems()
        _settings(policy, routing, one)
        for p in one.found:
            if p not in found.found:  # two policies may read the same key
                found.add(p)
    own = sorted(f.name for f in fields(RoutingConfig) if f.name != "policy_keys")
    for key, _ in routing.policy_keys:
        if key not in known:
            found.add(f"routing.{key}: unknown key (expected one of: {', '.join(sorted(known.union(own)))})")
    return found.found


def check(routing: RoutingConfig) -> None:
    """A ConfigError naming every wrong policy key (router.toml is parsed, then this)."""
    found = problems(routing)
    if found:
        raise ConfigError(*found)


def settings(routing: RoutingConfig, name: str | None = None) -> Any:
    """The settings of policy `name` (default: the configured one), from checked keys."""
    return _settings(POLICIES[name or routing.strategy], routing, Problems())


def make_strategy(routing: RoutingConfig) -> Strategy:
    """A fresh planner for `routing.strategy`; a ConfigError if a policy's keys are wrong."""
    check(routing)
    policy = POLICIES[routing.strategy]
    return policy(routing, settings(routing))
