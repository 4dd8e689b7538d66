"""Configuration from the environment and the command line, layered over router.toml.

Precedence: command-line flag, then environment variable, then the file, then the
default. Secrets belong in the environment (a Kubernetes Secret, a systemd credential),
not in the file. An empty variable counts as unset: an empty CACHEHIT_ROUTER_API_KEYS must
not switch authentication off by accident. The layered tables go through the same
validation as the file (router/config/schema.py); a value the environment got wrong is named by
its variable.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from router.config.schema import ConfigError


def _keys(var: str, value: str) -> list[str]:
    keys = [k.strip() for k in value.split(",") if k.strip()]
    if not keys:
        raise ConfigError(f"{var}: expected comma-separated keys, got {value!r}")
    return keys


def _int(var: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{var}: expected an integer, got {value!r}") from None


def _str(var: str, value: str) -> str:
    return value


# variable -> (table, key, parse)
ENVIRONMENT: dict[str, tuple[str, str, Callable[[str, str], Any]]] = {
    "CACHEHIT_ROUTER_API_KEYS": ("server", "api_keys", _keys),
    "CACHEHIT_ROUTER_ADMIN_API_KEY": ("server", "admin_api_key", _str),
    "CACHEHIT_ROUTER_HOST": ("server", "host", _str),
    "CACHEHIT_ROUTER_PORT": ("server", "port", _int),
    "CACHEHIT_ROUTER_LOG_LEVEL": ("server", "log_level", _str),
    "CACHEHIT_ROUTER_STRATEGY": ("routing", "strategy", _str),
}
# For every [[backends]] and [[discovery]] table without its own api_key.
BACKEND_API_KEY = "CACHEHIT_ROUTER_BACKEND_API_KEY"
CONFIG_PATH = "CACHEHIT_ROUTER_CONFIG"


def layer(raw: dict[str, Any], env: Mapping[str, str], flags: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`raw` (the file's tables) with the environment's and the flags' values on top.
    flags: {"server.host": ..., "server.port": ..., "server.log_level": ...}; None values
    are not given."""
    out = copy.deepcopy(raw)
    problems: list[str] = []
    for var, (table, key, parse) in ENVIRONMENT.items():
        value = env.get(var, "")
        if not value:
            continue
        try:
            parsed = parse(var, value)
        except ConfigError as e:
            problems += e.problems
            continue
        section = out.setdefault(table, {})
        if isinstance(section, dict):
            section[key] = parsed
    backend_key = env.get(BACKEND_API_KEY, "")
    if backend_key:
        for array in ("backends", "discovery"):
            for t in out.get(array, []) if isinstance(out.get(array), list) else []:
                if isinstance(t, dict) and not t.get("api_key"):
                    t["api_key"] = backend_key
    for dotted, given in (flags or {}).items():
        if given is None:
            continue
        table, key = dotted.split(".", 1)
        section = out.setdefault(table, {})
        if isinstance(section, dict):
            section[key] = given
    if problems:
        raise ConfigError(*problems)
    return out
