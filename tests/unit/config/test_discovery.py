"""[[discovery]] tables (router/config/discovery.py): validated at start with messages naming
the key, documented."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from router.config.discovery import parse_nameserver
from router.config.parse import parse_config
from router.config.schema import ConfigError, DiscoveryConfig

ROOT = Path(__file__).resolve().parents[3]


def test_a_discovery_table_alone_is_a_valid_fleet() -> None:
    cfg = parse_config({"discovery": [{"name": "vllm.ns.svc.cluster.local", "nameservers": ["10.0.0.10:53"]}]})
    (d,) = cfg.discovery
    assert (d.kind, d.port, d.role, d.interval_s) == ("dns", 8000, "decode", 10.0)
    assert cfg.to_dict()["discovery"][0]["name"] == "vllm.ns.svc.cluster.local"


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"kind": "srv", "name": "x"}, "discovery[0].kind: expected one of dns, kubernetes, got 'srv'"),
        ({"kind": "dns"}, "discovery[0].name: required for kind 'dns'"),
        ({"kind": "kubernetes"}, "discovery[0].label_selector: required for kind 'kubernetes'"),
        ({"name": "x", "port": 0}, "discovery[0].port: expected a TCP port in [1, 65535], got 0"),
        ({"name": "x", "interval_s": 0}, "discovery[0].interval_s: expected a positive number"),
        ({"name": "x", "role": "boss"}, "discovery[0].role: expected one of decode, prefill, both"),
        ({"name": "x", "scheme": "ftp"}, "discovery[0].scheme: expected 'http' or 'https'"),
        (
            {"name": "x", "nameservers": ["dns.example:53"]},
            "discovery[0].nameservers[0]: expected an IP address with an optional :port",
        ),
        ({"name": "x", "nameservers": ["10.0.0.1:99999"]}, "discovery[0].nameservers[0]: expected a TCP port"),
        ({"name": "x", "bogus": 1}, "discovery[0].bogus: unknown key"),
        (
            {"kind": "kubernetes", "label_selector": "a=b", "api_server": "ftp://x"},
            "discovery[0].api_server: expected an http:// or https:// URL",
        ),
    ],
)
def test_bad_tables_name_the_key(table: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"backends": [{"name": "a", "url": "http://127.0.0.1:1"}], "discovery": [table]})
    assert any(p.startswith(expected) for p in e.value.problems), e.value.problems


def test_prefill_only_discovery_is_not_a_fleet_and_duplicates_are_refused() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"discovery": [{"name": "p", "role": "prefill"}]})
    assert "at least one backend" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_config({"discovery": [{"name": "d"}, {"name": "d", "port": 9000}]})
    assert "discovery: two tables look up the same 'd'" in str(e.value)


def test_nameserver_forms() -> None:
    assert parse_nameserver("k", "10.0.0.2") == ("10.0.0.2", 53)
    assert parse_nameserver("k", "10.0.0.2:5353") == ("10.0.0.2", 5353)
    assert parse_nameserver("k", "::1") == ("::1", 53)
    assert parse_nameserver("k", "[::1]:5353") == ("::1", 5353)


def test_every_discovery_key_is_documented() -> None:
    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    assert "## [[discovery]]" in doc
    for f in dataclasses.fields(DiscoveryConfig):
        assert f"`{f.name}`" in doc, f"discovery.{f.name} is not documented in docs/CONFIG.md"
