"""router.toml's tables -> a validated `Config`: one parser per section, each reporting
every problem of its table by key.

The schema (the dataclasses and their defaults) is router/config/schema.py; the checks they are
made of are router/config/checks.py; `[[discovery]]` is router/config/discovery.py and
`[[tenants]]` router/admission/tenants.py; each routing policy checks the keys it reads
(router/routing/policies/, `check`, called where a configuration is loaded to run).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import logging
import math
import os
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.config.checks import (
    Problems,
    build_table,
    check_fraction,
    check_one_of,
    check_port,
    check_positive,
    check_stretch,
    check_url,
    int_list,
    str_list,
    string_table,
)
from router.config.data_parallel import expand_ranks
from router.config.discovery import parse_discovery
from router.config.kv_events import check_backend_kv_events, check_engine_kv_events, parse_kv_events
from router.config.schema import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    BackendConfig,
    Config,
    ConfigError,
    EngineConfig,
    HealthConfig,
    LauncherConfig,
    RoutingConfig,
    ServerConfig,
    TenantConfig,
    TimeoutsConfig,
    TracingConfig,
)
from router.names import EngineKind, EngineRole, Role, SplitMode

# Keys of earlier versions whose job the cost model does now: accepted with a warning so
# that an old configuration still starts.
RETIRED_KEYS = {
    "routing.fallback_load_tokens": "the fallback weighs load by the cost model's predicted time to first token",
    "routing.probe_deadline_per_token_ms": "the race deadline follows the engines' measured prefill speed",
}


def _without_retired(table: Any, key: str) -> Any:
    if not isinstance(table, dict):
        return table
    kept = {}
    for k, v in table.items():
        why = RETIRED_KEYS.get(f"{key}.{k}")
        if why is None:
            kept[k] = v
        else:
            logging.getLogger("cachehit_router.config").warning("%s.%s is ignored: %s", key, k, why)
    return kept


def parse_server(p: Problems, raw: Any) -> ServerConfig | None:
    server = build_table(p, ServerConfig, "server", raw, {"api_keys": str_list})
    if server is None:
        return None
    p.check(check_port, "server.port", server.port, allow_zero=True)
    p.check(check_positive, "server.max_body_bytes", server.max_body_bytes)
    p.check(check_positive, "server.max_upload_bytes", server.max_upload_bytes)
    if server.max_body_bytes_in_flight < server.max_body_bytes:
        p.add(
            f"server.max_body_bytes_in_flight: expected at least server.max_body_bytes "
            f"({server.max_body_bytes}), got {server.max_body_bytes_in_flight}"
        )
    p.check(check_positive, "server.max_concurrent_requests", server.max_concurrent_requests)
    p.check(check_positive, "server.max_queued_requests", server.max_queued_requests, allow_zero=True)
    p.check(check_positive, "server.queue_timeout_s", server.queue_timeout_s, allow_zero=True)
    p.check(check_positive, "server.drain_timeout_s", server.drain_timeout_s, allow_zero=True)
    p.check(check_positive, "server.body_timeout_s", server.body_timeout_s)
    p.check(check_positive, "server.header_timeout_s", server.header_timeout_s)
    p.check(check_positive, "server.keepalive_timeout_s", server.keepalive_timeout_s)
    if not 1024 <= server.max_header_bytes <= 16 * 2**20:
        p.add(f"server.max_header_bytes: expected an integer in [1024, 16777216], got {server.max_header_bytes}")
    if not 4096 <= server.stream_buffer_bytes <= 16 * 2**20:
        p.add(f"server.stream_buffer_bytes: expected an integer in [4096, 16777216], got {server.stream_buffer_bytes}")
    if not 4096 <= server.engine_read_bytes <= 16 * 2**20:
        p.add(f"server.engine_read_bytes: expected an integer in [4096, 16777216], got {server.engine_read_bytes}")
    if bool(server.tls_cert) != bool(server.tls_key):
        p.add("server.tls_cert: tls_cert and tls_key must be given together")
    if server.log_level not in ("debug", "info", "warning", "error"):
        p.add(f"server.log_level: expected one of debug, info, warning, error, got {server.log_level!r}")
    if server.log_format not in ("json", "text"):
        p.add(f"server.log_format: expected json or text, got {server.log_format!r}")
    if any(not k for k in server.api_keys):
        p.add("server.api_keys: expected non-empty strings")
    return server


def split_routing_table(raw: dict[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, Any], ...]]:
    """[routing] as (the pipeline's own keys, the rest as sorted pairs): the rest belong to
    the policies, which parse and check them (router/routing/policies/)."""
    own = {f.name for f in dataclasses.fields(RoutingConfig)} - {"policy_keys"}
    return {k: v for k, v in raw.items() if k in own}, tuple(sorted((k, v) for k, v in raw.items() if k not in own))


def parse_routing(p: Problems, raw: Any) -> RoutingConfig | None:
    raw = _without_retired(raw, "routing")
    if not isinstance(raw, dict):
        p.add(f"routing: expected a table, got {raw!r}")
        return None
    own, policy_keys = split_routing_table(raw)
    routing = build_table(p, RoutingConfig, "routing", own, {"lora_adapters": string_table})
    if routing is None:
        return None
    routing = dataclasses.replace(routing, policy_keys=policy_keys)
    p.check(check_one_of, "routing.split", routing.split, SplitMode)
    p.check(check_one_of, "routing.spare_producers", routing.spare_producers, SplitMode)
    p.check(check_positive, "routing.slo_ttft_ms", routing.slo_ttft_ms)
    p.check(check_positive, "routing.slo_itl_ms", routing.slo_itl_ms)
    p.check(check_stretch, "routing.max_ttft_stretch", routing.max_ttft_stretch)
    p.check(check_positive, "routing.prefill_chunk_tokens", routing.prefill_chunk_tokens)
    p.check(check_fraction, "routing.decode_guard_threshold", routing.decode_guard_threshold)
    p.check(check_positive, "routing.min_pd_prompt_tokens", routing.min_pd_prompt_tokens, allow_zero=True)
    p.check(check_positive, "routing.prior_prefill_tokens_per_s", routing.prior_prefill_tokens_per_s)
    p.check(check_positive, "routing.prior_kv_transfer_tokens_per_s", routing.prior_kv_transfer_tokens_per_s)
    p.check(check_positive, "routing.max_resumes", routing.max_resumes, allow_zero=True)
    p.check(check_positive, "routing.max_retries", routing.max_retries, allow_zero=True)
    p.check(check_positive, "routing.prefix_memory_bytes", routing.prefix_memory_bytes)
    p.check(check_positive, "routing.max_adapters_per_engine", routing.max_adapters_per_engine)
    return routing


def parse_timeouts(p: Problems, raw: Any) -> TimeoutsConfig | None:
    timeouts = build_table(p, TimeoutsConfig, "timeouts", raw)
    if timeouts is not None:
        for f in dataclasses.fields(TimeoutsConfig):
            p.check(check_positive, f"timeouts.{f.name}", getattr(timeouts, f.name))
    return timeouts


def parse_health(p: Problems, raw: Any) -> HealthConfig | None:
    health = build_table(p, HealthConfig, "health", raw)
    if health is not None:
        p.check(check_positive, "health.scrape_interval_s", health.scrape_interval_s)
        p.check(check_positive, "health.check_interval_s", health.check_interval_s)
        p.check(check_positive, "health.failure_threshold", health.failure_threshold)
        p.check(check_positive, "health.cooldown_s", health.cooldown_s, allow_zero=True)
        p.check(check_positive, "health.slow_engine_s", health.slow_engine_s, allow_zero=True)
    return health


def parse_launcher(p: Problems, raw: Any) -> LauncherConfig | None:
    launcher = build_table(p, LauncherConfig, "launcher", raw)
    if launcher is not None:
        p.check(check_positive, "launcher.startup_timeout_s", launcher.startup_timeout_s)
        p.check(check_positive, "launcher.max_restarts", launcher.max_restarts, allow_zero=True)
        p.check(check_positive, "launcher.restart_backoff_s", launcher.restart_backoff_s, allow_zero=True)
    return launcher


def parse_tracing(p: Problems, raw: Any) -> TracingConfig | None:
    tracing = build_table(p, TracingConfig, "tracing", raw)
    if tracing is None:
        return None
    p.check(check_url, "tracing.otlp_endpoint", tracing.otlp_endpoint)
    p.check(check_fraction, "tracing.sample_ratio", tracing.sample_ratio)
    p.check(check_positive, "tracing.export_timeout_s", tracing.export_timeout_s)
    if tracing.enabled and importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is None:
        p.add(
            "tracing.enabled: needs the OpenTelemetry SDK and OTLP/HTTP exporter: "
            "pip install 'cachehit-router[tracing]'"
        )
    return tracing


def _array(p: Problems, raw: Any, key: str) -> list[Any]:
    if not isinstance(raw, list):
        p.add(f"{key}: expected an array of tables ([[{key}]])")
        return []
    return raw


def parse_backends(p: Problems, raw: Any) -> list[BackendConfig]:
    backends = []
    for i, table in enumerate(_array(p, raw, "backends")):
        key = f"backends[{i}]"
        b = build_table(p, BackendConfig, key, table, {"models": str_list})
        if b is None:
            continue
        p.check(check_url, f"{key}.url", b.url)
        p.check(check_positive, f"{key}.prefill_tokens_per_s", b.prefill_tokens_per_s, allow_zero=True)
        p.check(check_positive, f"{key}.prefill_chunk_tokens", b.prefill_chunk_tokens, allow_zero=True)
        p.check(check_one_of, f"{key}.role", b.role, Role)
        check_backend_kv_events(p, key, b)
        if b.data_parallel_size < 1:
            p.add(f"{key}.data_parallel_size: expected an integer >= 1, got {b.data_parallel_size!r}")
            continue
        if not -1 <= b.data_parallel_rank < b.data_parallel_size:
            p.add(f"{key}.data_parallel_rank: expected a rank below data_parallel_size, got {b.data_parallel_rank!r}")
            continue
        # One backend per DP rank: each is its own engine to the router.
        backends.extend(expand_ranks(b))
    return backends


def parse_engines(p: Problems, raw: Any) -> list[EngineConfig]:
    engines = []
    for i, table in enumerate(_array(p, raw, "engines")):
        key = f"engines[{i}]"
        e = build_table(
            p,
            EngineConfig,
            key,
            table,
            {"gpu_ids": int_list, "cpu_cores": int_list, "extra_args": str_list, "env": string_table},
        )
        if e is None:
            continue
        p.check(check_one_of, f"{key}.kind", e.kind, EngineKind)
        p.check(check_one_of, f"{key}.role", e.role, EngineRole)
        if e.kind == EngineKind.VLLM and not e.model:
            p.add(f"{key}.model: required for kind 'vllm' (a model path or name)")
        p.check(check_port, f"{key}.port", e.port, allow_zero=True)
        p.check(check_port, f"{key}.nixl_side_channel_port", e.nixl_side_channel_port, allow_zero=True)
        p.check(check_positive, f"{key}.kv_offload_gib", e.kv_offload_gib, allow_zero=True)
        check_engine_kv_events(p, key, e)
        try:
            ipaddress.ip_address(e.host)
        except ValueError:
            if e.host != "localhost":
                p.add(f"{key}.host: expected an IP address or 'localhost', got {e.host!r}")
        engines.append(e)
    return engines


def parse_tenants(p: Problems, raw: Any, api_keys: tuple[str, ...]) -> list[TenantConfig]:
    if not isinstance(raw, list):
        p.add("tenants: expected an array of tables ([[tenants]])")
        return []
    out: list[TenantConfig] = []
    for i, table in enumerate(raw):
        key = f"tenants[{i}]"
        t = build_table(p, TenantConfig, key, table)
        if t is not None:
            out.append(validate_tenant(key, t, os.environ, p.add))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        p.add("tenants: duplicate tenant name")
    keys = [t.api_key for t in out if t.api_key] + list(api_keys)
    if len(set(keys)) != len(keys):
        p.add("tenants: the same API key is given twice (tenants[].api_key, server.api_keys)")
    return out


def _check_names(p: Problems, backends: list[BackendConfig], engines: list[EngineConfig]) -> None:
    seen: set[str] = set()
    for n in [b.name for b in backends] + [e.name for e in engines if e.register]:
        if not n:
            p.add("backends: a backend or engine has an empty name")
        elif n in seen:
            p.add(f"backends: duplicate backend or engine name {n!r}")
        seen.add(n)
    engine_names = [e.name for e in engines]
    if len(set(engine_names)) != len(engine_names):
        p.add("engines: duplicate engine name")


def parse_sections(raw: dict[str, Any]) -> Config:
    """The validated configuration; a ConfigError lists every problem found."""
    p = Problems()
    top = {f.name for f in dataclasses.fields(Config)}
    for k in raw:
        if k not in top:
            p.add(f"{k}: unknown key (expected one of: {', '.join(sorted(top))})")
    server = parse_server(p, raw.get("server", {}))
    routing = parse_routing(p, raw.get("routing", {}))
    timeouts = parse_timeouts(p, raw.get("timeouts", {}))
    health = parse_health(p, raw.get("health", {}))
    launcher = parse_launcher(p, raw.get("launcher", {}))
    tracing = parse_tracing(p, raw.get("tracing", {}))
    backends = parse_backends(p, raw.get("backends", []))
    engines = parse_engines(p, raw.get("engines", []))
    discovery = parse_discovery(p, raw.get("discovery", []))
    kv_events = parse_kv_events(p, raw.get("kv_events", {}))
    _check_names(p, backends, engines)
    tenants = parse_tenants(p, raw.get("tenants", []), server.api_keys if server is not None else ())
    p.raise_if_any()

    # raise_if_any raised if a section failed to parse: every one is here.
    assert server
    assert routing
    assert timeouts
    assert health
    assert launcher
    assert tracing
    assert kv_events
    cfg = Config(
        server=server,
        routing=routing,
        timeouts=timeouts,
        health=health,
        launcher=launcher,
        tracing=tracing,
        backends=tuple(backends),
        engines=tuple(engines),
        tenants=tuple(tenants),
        discovery=discovery,
        kv_events=kv_events,
    )
    # Only once everything else holds: a backend that failed to parse is not counted.
    if not any(b.decodes for b in cfg.all_backends()) and not any(d.role != Role.PREFILL for d in discovery):
        raise ConfigError(
            "backends: expected at least one backend (or registered engine, or [[discovery]] "
            "table) with role 'decode' or 'both' (engine role 'consumer' or 'both')"
        )
    return cfg


_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def validate_tenant(
    key: str, t: TenantConfig, environ: dict[str, str] | os._Environ[str], add: Callable[[str], None]
) -> TenantConfig:
    """Problems of one [[tenants]] table, each naming its key; the tenant with its key
    resolved from the environment."""
    if not _TENANT_NAME.fullmatch(t.name):
        add(f"{key}.name: expected 1-64 letters, digits, '_', '.' or '-', got {t.name!r}")
    if bool(t.api_key) == bool(t.api_key_env):
        add(f"{key}.api_key: expected exactly one of api_key and api_key_env")
    elif t.api_key_env:
        value = environ.get(t.api_key_env, "")
        if not value:
            add(f"{key}.api_key_env: environment variable {t.api_key_env!r} is not set or empty")
        t = TenantConfig(**{**t.__dict__, "api_key": value})
    for f in ("max_concurrent_requests", "max_queued_requests", "burst"):
        if getattr(t, f) < 0:
            add(f"{key}.{f}: expected a non-negative integer, got {getattr(t, f)!r}")
    if t.requests_per_s < 0 or not math.isfinite(t.requests_per_s):
        add(f"{key}.requests_per_s: expected a non-negative number, got {t.requests_per_s!r}")
    if not MIN_PRIORITY <= t.max_priority <= MAX_PRIORITY:
        add(f"{key}.max_priority: expected an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {t.max_priority!r}")
    return t


def parse_config(raw: dict[str, Any]) -> Config:
    """The validated configuration; a ConfigError lists every problem found."""
    return parse_sections(raw)


def load_config(path: str | Path) -> Config:
    return parse_config(read_toml(path))


def read_toml(path: str | Path) -> dict[str, Any]:
    """The file's tables, before validation (router/config/overrides.py layers the environment on)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read configuration file {str(p)!r}: {e.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    return raw
