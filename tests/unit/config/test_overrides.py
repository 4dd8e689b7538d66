"""Environment and flags over router.toml (router/config/overrides.py): precedence, empty
variables, the backends' shared key, and problems named by their variable."""

from __future__ import annotations

from typing import Any

import pytest

from router.config.overrides import layer
from router.config.schema import ConfigError

RAW: dict[str, Any] = {"server": {"host": "0.0.0.0", "port": 8000}, "backends": [{"name": "d0", "url": "http://d0"}]}


def test_a_flag_beats_the_environment_which_beats_the_file() -> None:
    assert layer(RAW, {})["server"]["port"] == 8000
    assert layer(RAW, {"CACHEHIT_ROUTER_PORT": "9000"})["server"]["port"] == 9000
    assert layer(RAW, {"CACHEHIT_ROUTER_PORT": "9000"}, {"server.port": 9100})["server"]["port"] == 9100
    # A flag that was not given leaves the layers below it alone.
    assert layer(RAW, {"CACHEHIT_ROUTER_PORT": "9000"}, {"server.port": None})["server"]["port"] == 9000
    assert RAW["server"]["port"] == 8000  # the file's tables are not changed in place


def test_an_empty_variable_counts_as_unset() -> None:
    assert "api_keys" not in layer(RAW, {"CACHEHIT_ROUTER_API_KEYS": ""})["server"]
    assert layer(RAW, {"CACHEHIT_ROUTER_API_KEYS": " a, b ,"})["server"]["api_keys"] == ["a", "b"]


def test_the_backend_key_fills_only_tables_without_their_own() -> None:
    raw = {"backends": [{"name": "d0", "url": "http://d0"}, {"name": "d1", "url": "http://d1", "api_key": "own"}]}
    out = layer(raw, {"CACHEHIT_ROUTER_BACKEND_API_KEY": "shared"})
    assert [b.get("api_key") for b in out["backends"]] == ["shared", "own"]


def test_bad_values_are_named_by_their_variable_all_at_once() -> None:
    with pytest.raises(ConfigError) as e:
        layer(RAW, {"CACHEHIT_ROUTER_PORT": "eighty", "CACHEHIT_ROUTER_API_KEYS": " , "})
    assert len(e.value.problems) == 2
    assert any(p.startswith("CACHEHIT_ROUTER_PORT:") for p in e.value.problems)
    assert any(p.startswith("CACHEHIT_ROUTER_API_KEYS:") for p in e.value.problems)
