"""router.toml validation: good files load, bad ones name the key and what was expected."""

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from router.config.parse import load_config, parse_config
from router.config.schema import BackendConfig, ConfigError, RoutingConfig
from router.names import EngineRole, Role, SplitMode
from router.routing import policies
from router.server.settings import parse_checked

ROOT = Path(__file__).resolve().parents[2]
MIN_BACKEND = {"backends": [{"name": "d0", "url": "http://127.0.0.1:9001"}]}


def test_repository_router_toml_is_valid() -> None:
    cfg = load_config(ROOT / "router.toml")
    backends = cfg.all_backends()
    assert [b.role for b in backends].count(Role.DECODE) == 4
    assert [b.role for b in backends].count(Role.PREFILL) == 1
    assert all(b.url.startswith("http://127.0.0.1:") for b in backends)


def test_defaults_are_safe() -> None:
    cfg = parse_config(MIN_BACKEND)
    assert cfg.server.host == "127.0.0.1"
    assert cfg.server.max_body_bytes > 0
    assert cfg.server.max_concurrent_requests > 0
    assert 0 < policies.settings(cfg.routing, "probe").cache_hit_threshold <= 1
    assert cfg.timeouts.total_s > 0
    assert cfg.timeouts.idle_s > 0
    assert cfg.server.reuse_port is False  # one process owns its port unless asked
    assert parse_config({**MIN_BACKEND, "server": {"reuse_port": True}}).server.reuse_port is True


@pytest.mark.parametrize(
    ("raw", "key", "expected"),
    [
        ({**MIN_BACKEND, "sevrer": {}}, "sevrer", "unknown key"),
        ({**MIN_BACKEND, "server": {"port": "8000"}}, "server.port", "expected an integer"),
        ({**MIN_BACKEND, "server": {"port": 70000}}, "server.port", "TCP port"),
        ({**MIN_BACKEND, "server": {"colour": 1}}, "server.colour", "unknown key"),
        ({**MIN_BACKEND, "routing": {"cache_hit_threshold": 1.5}}, "routing.cache_hit_threshold", "[0, 1]"),
        ({**MIN_BACKEND, "routing": {"strategy": "random"}}, "routing.strategy", "expected one of"),
        ({**MIN_BACKEND, "timeouts": {"idle_s": 0}}, "timeouts.idle_s", "positive"),
        ({"backends": [{"name": "d0", "url": "ftp://x"}]}, "backends[0].url", "http:// or https://"),
        ({"backends": [{"name": "d0", "url": "http://"}]}, "backends[0].url", "with a host"),
        ({"backends": [{"name": "d0", "url": "http://h:99999"}]}, "backends[0].url", "valid port"),
        ({"backends": [{"name": "d0", "url": "http://h", "role": "x"}]}, "backends[0].role", "expected one of"),
        ({"backends": [{"url": "http://h"}]}, "backends[0].name", "required"),
        (
            {"backends": [{"name": "d0", "url": "http://h", "prefill_chunk_tokens": -512}]},
            "backends[0].prefill_chunk_tokens",
            "non-negative",
        ),
        (
            {"backends": [{"name": "d0", "url": "http://h", "kv_events_endpoint": "http://h:5557"}]},
            "backends[0].kv_events_endpoint",
            "tcp://host:port",
        ),
        (
            {"backends": [{"name": "d0", "url": "http://h", "kv_events_replay_endpoint": "tcp://h:5558"}]},
            "backends[0].kv_events_replay_endpoint",
            "needs kv_events_endpoint",
        ),
        ({**MIN_BACKEND, "kv_events": {"stale_after_s": 0}}, "kv_events.stale_after_s", "positive"),
        ({"backends": [{"name": "p", "url": "http://h", "role": "prefill"}]}, "backends", "at least one backend"),
        ({"backends": []}, "backends", "at least one backend"),
        ({"backends": [{"name": "a", "url": "http://h"}, {"name": "a", "url": "http://i"}]}, "backends", "duplicate"),
        ({"engines": [{"name": "e", "kind": "gpu"}]}, "engines[0].kind", "expected one of"),
        ({"engines": [{"name": "e", "kind": "vllm", "role": "consumer"}]}, "engines[0].model", "required"),
        ({"engines": [{"name": "e", "kind": "sim", "host": "example.com"}]}, "engines[0].host", "IP address"),
        ({"engines": [{"name": "e", "kind": "sim", "kv_events_port": 70000}]}, "engines[0].kv_events_port", "port"),
        ({"engines": [{"name": "e", "kind": "sim", "kv_events": "yes"}]}, "engines[0].kv_events", "boolean"),
        (
            {"engines": [{"name": "e", "kind": "sim", "kv_events": False, "kv_events_replay_port": 5558}]},
            "engines[0].kv_events_replay_port",
            "kv_events = false",
        ),
        (
            {
                "engines": [
                    {
                        "name": "e",
                        "kind": "sim",
                        "host": "0.0.0.0",
                        "kv_events_port": 5557,
                        "kv_events_replay_port": 5557,
                    }
                ]
            },
            "engines[0].kv_events_replay_port",
            "same port",
        ),
        # A loopback engine publishes on ipc sockets: event ports would listen everywhere.
        ({"engines": [{"name": "e", "kind": "sim", "kv_events_port": 5557}]}, "engines[0].kv_events_port", "loopback"),
        (
            {"engines": [{"name": "e", "kind": "sim", "host": "::1", "kv_events_replay_port": 5558}]},
            "engines[0].kv_events_replay_port",
            "ipc://",
        ),
        ({**MIN_BACKEND, "server": {"api_keys": ["ok", 3]}}, "server.api_keys", "list of strings"),
        ({**MIN_BACKEND, "routing": {"prefix_memory_bytes": 0}}, "routing.prefix_memory_bytes", "positive"),
        (
            {**MIN_BACKEND, "routing": {"max_ttft_stretch": 0.5}},
            "routing.max_ttft_stretch",
            "0 (no bound) or a number >= 1",
        ),
        ({**MIN_BACKEND, "server": {"tls_cert": "c.pem"}}, "server.tls_cert", "together"),
        ({**MIN_BACKEND, "server": {"stream_buffer_bytes": 100}}, "server.stream_buffer_bytes", "[4096, 16777216]"),
        ({**MIN_BACKEND, "server": {"engine_read_bytes": 1000}}, "server.engine_read_bytes", "[4096, 16777216]"),
        ({**MIN_BACKEND, "server": {"reuse_port": "yes"}}, "server.reuse_port", "expected"),
        ({**MIN_BACKEND, "server": {"request_log": "off"}}, "server.request_log", "expected"),
        ({**MIN_BACKEND, "server": {"header_timeout_s": 0}}, "server.header_timeout_s", "positive"),
        (
            {**MIN_BACKEND, "server": {"max_body_bytes_in_flight": 1000}},
            "server.max_body_bytes_in_flight",
            "at least server.max_body_bytes",
        ),
        ({**MIN_BACKEND, "server": {"keepalive_timeout_s": -1}}, "server.keepalive_timeout_s", "positive"),
        ({**MIN_BACKEND, "server": {"max_header_bytes": 100}}, "server.max_header_bytes", "[1024, 16777216]"),
        ({**MIN_BACKEND, "tenants": [{"name": "a"}]}, "tenants[0].api_key", "exactly one of"),
        ({**MIN_BACKEND, "tenants": [{"name": "a b", "api_key": "k"}]}, "tenants[0].name", "letters"),
        (
            {**MIN_BACKEND, "tenants": [{"name": "a", "api_key": "k", "requests_per_s": -1}]},
            "tenants[0].requests_per_s",
            "non-negative",
        ),
        (
            {**MIN_BACKEND, "tenants": [{"name": "a", "api_key": "k", "max_priority": 1000}]},
            "tenants[0].max_priority",
            "[-100, 100]",
        ),
        (
            {**MIN_BACKEND, "tenants": [{"name": "a", "api_key_env": "CACHEHIT_TEST_UNSET_KEY"}]},
            "tenants[0].api_key_env",
            "not set",
        ),
        (
            {**MIN_BACKEND, "tenants": [{"name": "a", "api_key": "k"}, {"name": "a", "api_key": "j"}]},
            "tenants",
            "duplicate tenant name",
        ),
        (
            {**MIN_BACKEND, "server": {"api_keys": ["k"]}, "tenants": [{"name": "a", "api_key": "k"}]},
            "tenants",
            "twice",
        ),
    ],
)
def test_bad_configs_name_the_key(raw: dict[str, Any], key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_checked(raw)
    msg = str(e.value)
    assert msg.startswith(key), msg
    assert expected in msg, msg


def test_every_problem_is_reported_at_once() -> None:
    # One run names them all: an unknown key does not hide a bad value of the same table,
    # and a broken backend does not hide a broken engine.
    with pytest.raises(ConfigError) as e:
        parse_checked(
            {
                "server": {"port": "x", "foo": 1},
                "routing": {"bogus": 1, "cache_hit_threshold": 1.5, "strategy": "fast"},
                "backends": [{"url": "ftp://h"}, {"name": "d", "url": "ftp://h", "role": "x"}],
                "engines": [{"name": "e", "kind": "vllm", "role": "decoder", "host": "example.com"}],
            }
        )
    assert [m.split(":")[0] for m in e.value.problems] == [
        "server.port",
        "server.foo",
        "backends[0].name",
        "backends[1].url",
        "backends[1].role",
        "engines[0].role",
        "engines[0].model",
        "engines[0].host",
        # The policies' keys, checked by their registry after the configuration's own.
        "routing.strategy",
        "routing.cache_hit_threshold",
        "routing.bogus",
    ]
    report = e.value.report("router")
    assert report.startswith("router: 11 configuration errors:\n  server.port: expected an integer")
    assert ConfigError("x.y: bad").report("router") == "router: configuration error: x.y: bad"


def test_every_policy_module_is_registered_under_the_name_config_accepts() -> None:
    assert set(policies.POLICIES) == {"kv_events", "least_loaded", "prefix_tree", "probe", "round_robin"}
    assert all(name == cls.name for name, cls in policies.POLICIES.items())
    for name in policies.POLICIES:
        cfg = parse_checked({**MIN_BACKEND, "routing": {"strategy": name}})
        assert policies.make_strategy(cfg.routing).name == name


def test_a_policy_parses_and_checks_the_routing_keys_it_reads() -> None:
    bad = RoutingConfig(policy_keys=(("max_probes", -1), ("race", "sometimes")))
    assert policies.problems(bad) == [
        "routing.race: expected one of auto, always, got 'sometimes'",
        "routing.max_probes: expected a non-negative number, got -1",
    ]
    assert policies.settings(RoutingConfig(policy_keys=(("max_probes", 3),))).max_probes == 3
    # Checked whatever the strategy: a reload or the environment may switch to the policy
    # that reads them; the configuration itself keeps them as written.
    raw = {**MIN_BACKEND, "routing": {"strategy": "round_robin", "race": "sometimes"}}
    assert parse_config(raw).routing.policy_keys == (("race", "sometimes"),)
    with pytest.raises(ConfigError, match=r"routing\.race: expected one of auto, always"):
        parse_checked(raw)
    with pytest.raises(ConfigError, match=r"routing\.bogus: unknown key"):
        parse_checked({**MIN_BACKEND, "routing": {"bogus": 1}})


def test_parsed_names_are_enum_members_that_read_as_their_strings() -> None:
    cfg = parse_config(
        {
            **MIN_BACKEND,
            "routing": {"strategy": "prefix_tree", "split": "always"},
            "engines": [{"name": "p", "kind": "sim", "role": "producer", "port": 9001}],
        }
    )
    assert cfg.routing.strategy == "prefix_tree"
    assert cfg.routing.split is SplitMode.ALWAYS
    assert cfg.backends[0].role is Role.DECODE
    assert cfg.engines[0].role is EngineRole.PRODUCER
    assert cfg.engines[0].backend_role == "prefill"
    assert f"{policies.settings(cfg.routing, 'probe').race}" == "auto"


def test_engines_become_backends_with_mapped_roles() -> None:
    cfg = parse_config(
        {
            "engines": [
                {"name": "p", "kind": "sim", "role": "producer", "port": 9001, "model": "m"},
                {"name": "c", "kind": "sim", "role": "consumer", "port": 9002, "model": "m"},
                {"name": "x", "kind": "sim", "role": "both", "port": 9003, "register": False},
            ]
        }
    )
    b = {x.name: x for x in cfg.all_backends({"c": "http://127.0.0.1:9999"})}
    assert set(b) == {"p", "c"}
    assert b["p"].role == "prefill"
    assert b["c"].role == "decode"
    assert b["c"].url == "http://127.0.0.1:9999"
    assert b["p"].url == "http://127.0.0.1:9001"
    assert b["p"].models == ("m",)


def test_engines_kv_event_endpoints_come_from_the_launcher_or_the_configured_ports(tmp_path: Path) -> None:
    log_dir = str(tmp_path / "logs")
    cfg = parse_config(
        {
            "launcher": {"log_dir": log_dir},
            "engines": [
                {
                    "name": "a",
                    "kind": "sim",
                    "port": 9001,
                    "host": "10.0.0.5",
                    "kv_events_port": 5557,
                    "kv_events_replay_port": 5558,
                },
                {"name": "b", "kind": "sim", "port": 9002, "host": "0.0.0.0", "kv_events_port": 5559},
                {"name": "c", "kind": "sim", "port": 9003},  # loopback: ipc sockets
                {"name": "d", "kind": "sim", "port": 9004, "host": "::1"},
                {"name": "e", "kind": "sim", "port": 9005, "kv_events": False},
                {"name": "f", "kind": "sim", "port": 9006, "host": "0.0.0.0"},  # ports left to the launcher
            ],
        }
    )
    assert cfg.engines[0].kv_events is True

    def endpoints(backends: Iterable[BackendConfig]) -> dict[str, tuple[str, str]]:
        return {x.name: (x.kv_events_endpoint, x.kv_events_replay_endpoint) for x in backends}

    # Engines started elsewhere (router --no-engines): a loopback engine's ipc sockets under
    # the launcher's log_dir (the launcher's own deterministic paths), another engine's
    # configured ports, reached at its host (loopback for a wildcard).
    d = os.path.join(log_dir, "kv-events")
    assert endpoints(cfg.all_backends()) == {
        "a": ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"),
        "b": ("tcp://127.0.0.1:5559", ""),
        "c": (f"ipc://{d}/c.events", f"ipc://{d}/c.replay"),
        "d": (f"ipc://{d}/d.events", f"ipc://{d}/d.replay"),
        "e": ("", ""),
        "f": ("", ""),
    }
    # Engines the launcher started: what it reports, and nothing for the others.
    started = {"c": ("tcp://127.0.0.1:41000", "tcp://127.0.0.1:41001")}
    assert endpoints(cfg.all_backends({}, started)) == {
        "a": ("", ""),
        "b": ("", ""),
        "c": ("tcp://127.0.0.1:41000", "tcp://127.0.0.1:41001"),
        "d": ("", ""),
        "e": ("", ""),
        "f": ("", ""),
    }
    # Paths past the AF_UNIX limit: the launcher moves them to a temp directory the router
    # cannot derive, so it follows no stream.
    long = parse_config(
        {"launcher": {"log_dir": str(tmp_path / ("x" * 100))}, "engines": [{"name": "c", "kind": "sim"}]}
    )
    assert endpoints(long.all_backends()) == {"c": ("", "")}


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_check_config_prints_resolved_configuration() -> None:
    r = _run_cli("check-config", "--config", str(ROOT / "router.toml"))
    assert r.returncode == 0, r.stderr
    assert '"cache_hit_threshold": 0.5' in r.stdout
    assert "is valid" in r.stderr


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[routing]\ncache_hit_threshold = "high"\n[[backends]]\nname="a"\nurl="http://h"\n')
    r = _run_cli("--config", str(bad))
    assert r.returncode == 2
    assert "routing.cache_hit_threshold: expected a number" in r.stderr
    r = _run_cli("--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2
    assert "cannot read configuration file" in r.stderr
    bad.write_text("[server\n")
    r = _run_cli("check-config", "--config", str(bad))
    assert r.returncode == 2
    assert "not valid TOML" in r.stderr


def test_secrets_are_not_printed() -> None:
    cfg = parse_config({**MIN_BACKEND, "server": {"api_keys": ["sk-secret"], "admin_api_key": "adm"}})
    d = cfg.to_dict()
    assert "sk-secret" not in str(d)
    assert "adm" not in str(d["server"]["admin_api_key"])


def test_tenant_keys_come_from_the_environment_and_are_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEHIT_TEST_TENANT_KEY", "sk-from-env")
    cfg = parse_config(
        {
            **MIN_BACKEND,
            "tenants": [
                {
                    "name": "batch",
                    "api_key_env": "CACHEHIT_TEST_TENANT_KEY",
                    "max_concurrent_requests": 4,
                    "requests_per_s": 2.5,
                    "max_priority": 1,
                }
            ],
        }
    )
    (t,) = cfg.tenants
    assert (t.name, t.api_key, t.max_concurrent_requests, t.requests_per_s, t.max_priority) == (
        "batch",
        "sk-from-env",
        4,
        2.5,
        1,
    )
    assert "sk-from-env" not in str(cfg.to_dict())


def test_every_config_key_is_documented() -> None:
    import dataclasses

    from router.config import schema as c

    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    sections = {
        "server": c.ServerConfig,
        "routing": c.RoutingConfig,
        "timeouts": c.TimeoutsConfig,
        "health": c.HealthConfig,
        "launcher": c.LauncherConfig,
        "[backends]": c.BackendConfig,
        "[engines]": c.EngineConfig,
        "[tenants]": c.TenantConfig,
    }
    for section, cls in sections.items():
        assert f"## [{section}]" in doc, section
        for f in dataclasses.fields(cls):
            if f.name != "policy_keys":  # the policies' own keys, below
                assert f"`{f.name}`" in doc, f"{section}.{f.name} is not documented in docs/CONFIG.md"
    for name, policy in policies.POLICIES.items():
        for f in dataclasses.fields(policy.Settings):
            assert f"`{f.name}`" in doc, f"routing.{f.name} (policy {name}) is not documented in docs/CONFIG.md"
