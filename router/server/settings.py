"""A configuration to run with: router.toml (with the environment and flags over it)
parsed by router.config, and the `[routing]` keys the policies own checked by their
registry, every problem of both reported at once, each naming its key.

The configuration package is a leaf that knows no policy; this is where the two meet.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router.config import overrides
from router.config.parse import parse_config, read_toml, split_routing_table
from router.config.schema import Config, ConfigError, RoutingConfig
from router.routing import policies


def parse_checked(raw: dict[str, Any]) -> Config:
    """`raw`'s validated configuration; a ConfigError lists every problem, the policies' too."""
    try:
        config = parse_config(raw)
    except ConfigError as e:
        found = list(e.problems)
        table = raw.get("routing", {})
        if isinstance(table, dict):
            # The policies' keys are checked even when another table is wrong: one run
            # names every problem.
            own, policy_keys = split_routing_table(table)
            strategy = own.get("strategy", RoutingConfig.strategy)
            if isinstance(strategy, str):
                routing = RoutingConfig(strategy=strategy, policy_keys=policy_keys)
                found += [p for p in policies.problems(routing) if p not in found]
        raise ConfigError(*found) from None
    policies.check(config.routing)
    return config


def load_checked(path: str | Path, env: Mapping[str, str], flags: Mapping[str, Any] | None = None) -> Config:
    """The file at `path` with `env`'s and `flags`' values over it (router/config/overrides.py)."""
    return parse_checked(overrides.layer(read_toml(path), env, flags))
