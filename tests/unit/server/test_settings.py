"""A configuration to run with (router/server/settings.py): the file's problems and the
policies' problems reported in one run, each naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config.schema import ConfigError
from router.routing import policies
from router.server.settings import load_checked, parse_checked

BACKEND = {"backends": [{"name": "d0", "url": "http://127.0.0.1:9001"}]}


def test_the_policies_keys_are_checked_with_the_files_own() -> None:
    with pytest.raises(ConfigError) as e:
        parse_checked({"server": {"port": "x"}, "routing": {"race": "sometimes", "strategy": "fast"}, **BACKEND})
    assert [p.split(":")[0] for p in e.value.problems] == ["server.port", "routing.strategy", "routing.race"]


def test_a_valid_file_gives_the_policy_its_settings() -> None:
    cfg = parse_checked({**BACKEND, "routing": {"strategy": "kv_events", "max_probes": 2}})
    assert cfg.routing.strategy == "kv_events"
    assert policies.settings(cfg.routing, "probe").max_probes == 2
    assert policies.make_strategy(cfg.routing).name == "kv_events"


def test_the_environment_layers_over_the_file(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text('[[backends]]\nname = "d0"\nurl = "http://127.0.0.1:9001"\n[routing]\nstrategy = "probe"\n')
    assert load_checked(f, {"CACHEHIT_ROUTER_STRATEGY": "kv_events"}).routing.strategy == "kv_events"
    with pytest.raises(ConfigError, match=r"routing\.strategy: expected one of"):
        load_checked(f, {"CACHEHIT_ROUTER_STRATEGY": "random"})
