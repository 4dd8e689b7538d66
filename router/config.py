"""router.toml -> frozen dataclasses, validated at start.

Every error names the key (dotted path, with list indexes) and what was expected, so
`router check-config` and a failed start tell the user exactly what to fix.
Defaults are safe: listen on loopback, bounded bodies, bounded concurrency, timeouts on.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from .tenants import TenantConfig, validate_tenant

if TYPE_CHECKING:  # discovery_config imports this module
    from .discovery_config import DiscoveryConfig


class ConfigError(ValueError):
    """One or more configuration problems, one line each; every line names the key and
    what was expected."""

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("\n".join(problems))

    def report(self, prog: str) -> str:
        """What a command prints: one line for one problem, else a count and a line each."""
        if len(self.problems) == 1:
            return f"{prog}: configuration error: {self.problems[0]}"
        return "\n  ".join([f"{prog}: {len(self.problems)} configuration errors:", *self.problems])


ROLES = ("decode", "prefill", "both")
ENGINE_ROLES = ("producer", "consumer", "both")
ENGINE_KINDS = ("sim", "vllm")
STRATEGIES = ("probe", "round_robin", "least_loaded", "prefix_tree")
AUTO_OR_ALWAYS = ("auto", "always")
# An engine's role in the launcher maps to the router-side backend role.
ENGINE_ROLE_TO_BACKEND_ROLE = {"producer": "prefill", "consumer": "decode", "both": "both"}


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Client keys (Authorization: Bearer). Empty: no authentication.
    api_keys: tuple[str, ...] = ()
    # Key for admin routes (/admin/*). Empty: admin routes disabled.
    admin_api_key: str = ""
    max_body_bytes: int = 4 * 1024 * 1024
    # Audio uploads (multipart, streamed to the engine, never held whole): vLLM's own
    # default limit (VLLM_MAX_AUDIO_CLIP_FILESIZE_MB = 25).
    max_upload_bytes: int = 25 * 1024 * 1024
    # Requests executing at once; past it, up to max_queued_requests wait queue_timeout_s.
    max_concurrent_requests: int = 1024
    max_queued_requests: int = 1024
    queue_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0
    # Longest time to receive a request's body once its headers arrived (slow or stalled
    # clients get 408 instead of holding a concurrency slot).
    body_timeout_s: float = 30.0
    # Per stream: bytes the router holds for a client that reads slower than the engine
    # writes before it stops reading the engine (backpressure through the engine's socket).
    stream_buffer_bytes: int = 8 * 1024
    tls_cert: str = ""
    tls_key: str = ""
    log_level: str = "info"
    # json: one JSON object per line (log shippers); text: for humans (router/logs.py).
    log_format: str = "json"


@dataclass(frozen=True)
class RoutingConfig:
    strategy: str = "probe"
    # Fraction of the prompt an engine must already hold to accept a probe.
    cache_hit_threshold: float = 0.5
    # Threshold sent on decode legs (after a prefill, or when resuming); a small guard
    # lets a decode engine that lost the cache (preemption) hand the request back.
    decode_guard_threshold: float = 0.0
    # Prompts shorter than this never go prefill/decode (an operator's floor; above it the
    # cost model decides whether a split is faster).
    min_pd_prompt_tokens: int = 256
    # "auto": race when the measured saving of past races outweighs waiting for verdicts;
    # "always": race every request (the engines are the only index the router trusts).
    race: str = "auto"
    # "auto": a prompt nobody accepted is split (prefill/decode) when the cost model predicts
    # the split sooner; "always": split whenever a producer is available and the prompt is
    # over min_pd_prompt_tokens (keeps prefills off the decoders, for their inter-token
    # latency, which the time-to-first-token model does not weigh).
    split: str = "auto"
    # Probe race deadline floor; the cost model adds twice the slowest probed engine's
    # predicted time to first token as an acceptor. Silent engines then count as rejections.
    probe_deadline_ms: float = 250.0
    # Where the cost model's measured engine speeds start (router/speed_learner.py); the
    # router replaces them with measurements after a few requests per engine.
    prior_prefill_tokens_per_s: float = 10000.0
    prior_kv_transfer_tokens_per_s: float = 100000.0
    # Engines whose scraped waiting queue exceeds this are not probed (0: no bound).
    max_probe_waiting: int = 0
    # Probe at most this many engines per request (0: every available decode engine): those
    # the router last sent the prompt's longest known prefix to, then the least loaded.
    # Bounds the race's cost on large fleets (each probe is a request to an engine).
    max_probes: int = 0
    max_resumes: int = 3
    # Retries on another backend for failures before the first token.
    max_retries: int = 2


@dataclass(frozen=True)
class TimeoutsConfig:
    connect_s: float = 5.0
    first_token_s: float = 120.0
    idle_s: float = 60.0
    total_s: float = 900.0


@dataclass(frozen=True)
class HealthConfig:
    # Scrape of each backend's /metrics (load view) and /health (liveness).
    scrape_interval_s: float = 1.0
    check_interval_s: float = 2.0
    # Circuit breaker: open after this many consecutive failures, half-open after cooldown.
    failure_threshold: int = 3
    cooldown_s: float = 5.0


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry spans over OTLP/HTTP (router/tracing.py); needs the `tracing` extra."""

    enabled: bool = False
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = "cachehit-router"
    # Requests traced when the client sent no sampled traceparent (theirs is followed).
    sample_ratio: float = 1.0
    export_timeout_s: float = 10.0


@dataclass(frozen=True)
class BackendConfig:
    name: str
    url: str
    role: str = "decode"
    # Served model names. Empty: discovered from the backend's /v1/models.
    models: tuple[str, ...] = ()
    # Sent upstream as Authorization: Bearer; never taken from clients.
    api_key: str = ""
    # Expected prefill speed of this engine (its hardware), where the cost model's fit of
    # it starts; 0: routing.prior_prefill_tokens_per_s. Measurements replace it.
    prefill_tokens_per_s: float = 0.0

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")


@dataclass(frozen=True)
class EngineConfig:
    """An engine the launcher starts (kind sim or vllm)."""

    name: str
    kind: str
    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    model: str = ""
    served_model_name: str = ""
    # NIXL side channel (vllm only); port 0: pick a free one.
    nixl_side_channel_host: str = "127.0.0.1"
    nixl_side_channel_port: int = 0
    gpu_ids: tuple[int, ...] = ()
    cpu_cores: tuple[int, ...] = ()
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    # Also register as a router backend.
    register: bool = True
    # CPU tier of the KV cache (GiB of host memory per engine; 0: none): vLLM's
    # OffloadingConnector next to NIXL, or the simulator's CPU tier (docs/LAUNCHER.md).
    kv_offload_gib: float = 0.0

    @property
    def backend_role(self) -> str:
        return ENGINE_ROLE_TO_BACKEND_ROLE[self.role]


@dataclass(frozen=True)
class LauncherConfig:
    log_dir: str = "engine-logs"
    startup_timeout_s: float = 300.0
    max_restarts: int = 5
    restart_backoff_s: float = 1.0


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    backends: tuple[BackendConfig, ...] = ()
    engines: tuple[EngineConfig, ...] = ()
    # Client keys with limits of their own (router/tenants.py).
    tenants: tuple[TenantConfig, ...] = ()
    discovery: tuple[DiscoveryConfig, ...] = ()  # router/discovery_config.py

    def all_backends(self, engine_urls: dict[str, str] | None = None) -> tuple[BackendConfig, ...]:
        """Backends declared directly plus registered engines.

        engine_urls maps an engine name to its actual URL once the launcher picked a port.
        """
        out = list(self.backends)
        for e in self.engines:
            if not e.register:
                continue
            url = (engine_urls or {}).get(e.name) or f"http://{e.host}:{e.port}"
            models = (e.served_model_name or e.model,) if (e.served_model_name or e.model) else ()
            out.append(BackendConfig(name=e.name, url=url, role=e.backend_role, models=models))
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        # Secrets are never printed.
        d["server"]["api_keys"] = ["***"] * len(self.server.api_keys)
        if self.server.admin_api_key:
            d["server"]["admin_api_key"] = "***"
        for b in [*d["backends"], *d["discovery"]]:
            if b["api_key"]:
                b["api_key"] = "***"
        for t in d["tenants"]:
            t["api_key"] = "***"
        return d


# --- validation helpers -------------------------------------------------------------

class _Problems:
    """Every problem of one file, so that a single run reports them all instead of one
    per attempt. Checks are independent where they can be; only a table that is not a
    table, or lacks a required key, skips the checks of its values."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def add(self, message: str) -> None:
        self.found.append(message)

    def check(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), or None with its problems recorded."""
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            self.found.extend(e.problems)
            return None

    def raise_if_any(self) -> None:
        if self.found:
            raise ConfigError(*self.found)


def _type_name(t: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(t, str(t))


def _check(key: str, value: Any, typ: type) -> Any:
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {_type_name(typ)}, got {value!r}")
    return value


def _str_list(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
    return tuple(value)


def _int_list(key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{key}: expected a list of integers, got {value!r}")
    return tuple(value)


def _build(problems: _Problems, cls: type, key: str, raw: Any,
           special: dict[str, Any] | None = None) -> Any:
    """Dataclass `cls` from table `raw`. Unknown keys and wrong types are recorded in
    `problems` and the default is kept for them, so that the checks of the table's other
    values still run; None when `raw` is not a table or a required key is missing."""
    if not isinstance(raw, dict):
        problems.add(f"{key}: expected a table, got {raw!r}")
        return None
    special = special or {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        sub = f"{key}.{k}" if key else k
        if k not in fields:
            problems.add(f"{sub}: unknown key (expected one of: {', '.join(sorted(fields))})")
            continue
        default = fields[k].default
        if k in special:
            parse, args = special[k], (sub, v)
        elif isinstance(default, tuple):
            parse, args = _str_list, (sub, v)
        else:
            parse, args = _check, (sub, v, type(default) if default is not dataclasses.MISSING else str)
        found = len(problems.found)
        value = problems.check(parse, *args)
        if len(problems.found) == found:
            kwargs[k] = value
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]  # type: ignore[misc]
    for n in required:
        if n not in raw:
            problems.add(f"{key}.{n}: required key is missing")
    if any(n not in kwargs for n in required):  # missing, or of the wrong type
        return None
    return cls(**kwargs)


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: expected a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")


def _fraction(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{key}: expected a number in [0, 1], got {value!r}")


def _port(key: str, value: int, allow_zero: bool) -> None:
    if not (0 if allow_zero else 1) <= value <= 65535:
        raise ConfigError(f"{key}: expected a TCP port in [{0 if allow_zero else 1}, 65535], got {value!r}")


def _url(key: str, value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key}: expected an http:// or https:// URL with a host, got {value!r}")
    try:
        parts.port
    except ValueError:
        raise ConfigError(f"{key}: expected a valid port in URL, got {value!r}") from None
    if parts.query or parts.fragment:
        raise ConfigError(f"{key}: expected a base URL without query or fragment, got {value!r}")


def _env(key: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ConfigError(f"{key}: expected a table of strings, got {value!r}")
    return tuple(sorted(value.items()))


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


def parse_config(raw: dict[str, Any]) -> Config:
    """The validated configuration; a ConfigError lists every problem found."""
    p = _Problems()
    top = {f.name for f in dataclasses.fields(Config)}
    for k in raw:
        if k not in top:
            p.add(f"{k}: unknown key (expected one of: {', '.join(sorted(top))})")

    server = _build(p, ServerConfig, "server", raw.get("server", {}), {"api_keys": _str_list})
    if server is not None:
        p.check(_port, "server.port", server.port, allow_zero=True)
        p.check(_positive, "server.max_body_bytes", server.max_body_bytes)
        p.check(_positive, "server.max_upload_bytes", server.max_upload_bytes)
        p.check(_positive, "server.max_concurrent_requests", server.max_concurrent_requests)
        p.check(_positive, "server.max_queued_requests", server.max_queued_requests, allow_zero=True)
        p.check(_positive, "server.queue_timeout_s", server.queue_timeout_s, allow_zero=True)
        p.check(_positive, "server.drain_timeout_s", server.drain_timeout_s, allow_zero=True)
        p.check(_positive, "server.body_timeout_s", server.body_timeout_s)
        if not 4096 <= server.stream_buffer_bytes <= 16 * 2**20:
            p.add(f"server.stream_buffer_bytes: expected an integer in [4096, 16777216], "
                  f"got {server.stream_buffer_bytes}")
        if bool(server.tls_cert) != bool(server.tls_key):
            p.add("server.tls_cert: tls_cert and tls_key must be given together")
        if server.log_level not in ("debug", "info", "warning", "error"):
            p.add(f"server.log_level: expected one of debug, info, warning, error, got {server.log_level!r}")
        if server.log_format not in ("json", "text"):
            p.add(f"server.log_format: expected json or text, got {server.log_format!r}")
        if any(not k for k in server.api_keys):
            p.add("server.api_keys: expected non-empty strings")

    routing = _build(p, RoutingConfig, "routing", _without_retired(raw.get("routing", {}), "routing"))
    if routing is not None:
        if routing.race not in AUTO_OR_ALWAYS:
            p.add(f"routing.race: expected one of {', '.join(AUTO_OR_ALWAYS)}, got {routing.race!r}")
        if routing.split not in AUTO_OR_ALWAYS:
            p.add(f"routing.split: expected one of {', '.join(AUTO_OR_ALWAYS)}, got {routing.split!r}")
        if routing.strategy not in STRATEGIES:
            p.add(f"routing.strategy: expected one of {', '.join(STRATEGIES)}, got {routing.strategy!r}")
        p.check(_fraction, "routing.cache_hit_threshold", routing.cache_hit_threshold)
        p.check(_fraction, "routing.decode_guard_threshold", routing.decode_guard_threshold)
        p.check(_positive, "routing.min_pd_prompt_tokens", routing.min_pd_prompt_tokens, allow_zero=True)
        p.check(_positive, "routing.prior_prefill_tokens_per_s", routing.prior_prefill_tokens_per_s)
        p.check(_positive, "routing.prior_kv_transfer_tokens_per_s", routing.prior_kv_transfer_tokens_per_s)
        p.check(_positive, "routing.probe_deadline_ms", routing.probe_deadline_ms)
        p.check(_positive, "routing.max_probe_waiting", routing.max_probe_waiting, allow_zero=True)
        p.check(_positive, "routing.max_probes", routing.max_probes, allow_zero=True)
        p.check(_positive, "routing.max_resumes", routing.max_resumes, allow_zero=True)
        p.check(_positive, "routing.max_retries", routing.max_retries, allow_zero=True)

    timeouts = _build(p, TimeoutsConfig, "timeouts", raw.get("timeouts", {}))
    if timeouts is not None:
        for f in dataclasses.fields(TimeoutsConfig):
            p.check(_positive, f"timeouts.{f.name}", getattr(timeouts, f.name))

    health = _build(p, HealthConfig, "health", raw.get("health", {}))
    if health is not None:
        p.check(_positive, "health.scrape_interval_s", health.scrape_interval_s)
        p.check(_positive, "health.check_interval_s", health.check_interval_s)
        p.check(_positive, "health.failure_threshold", health.failure_threshold)
        p.check(_positive, "health.cooldown_s", health.cooldown_s, allow_zero=True)

    launcher = _build(p, LauncherConfig, "launcher", raw.get("launcher", {}))
    if launcher is not None:
        p.check(_positive, "launcher.startup_timeout_s", launcher.startup_timeout_s)
        p.check(_positive, "launcher.max_restarts", launcher.max_restarts, allow_zero=True)
        p.check(_positive, "launcher.restart_backoff_s", launcher.restart_backoff_s, allow_zero=True)

    tracing = _build(p, TracingConfig, "tracing", raw.get("tracing", {}))
    if tracing is not None:
        p.check(_url, "tracing.otlp_endpoint", tracing.otlp_endpoint)
        p.check(_fraction, "tracing.sample_ratio", tracing.sample_ratio)
        p.check(_positive, "tracing.export_timeout_s", tracing.export_timeout_s)
        if tracing.enabled and importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is None:
            p.add("tracing.enabled: needs the OpenTelemetry SDK and OTLP/HTTP exporter: "
                  "pip install 'cachehit-router[tracing]'")

    raw_backends = raw.get("backends", [])
    if not isinstance(raw_backends, list):
        p.add("backends: expected an array of tables ([[backends]])")
        raw_backends = []
    backends = []
    for i, rb in enumerate(raw_backends):
        key = f"backends[{i}]"
        b = _build(p, BackendConfig, key, rb, {"models": _str_list})
        if b is None:
            continue
        p.check(_url, f"{key}.url", b.url)
        p.check(_positive, f"{key}.prefill_tokens_per_s", b.prefill_tokens_per_s, allow_zero=True)
        if b.role not in ROLES:
            p.add(f"{key}.role: expected one of {', '.join(ROLES)}, got {b.role!r}")
        backends.append(b)

    raw_engines = raw.get("engines", [])
    if not isinstance(raw_engines, list):
        p.add("engines: expected an array of tables ([[engines]])")
        raw_engines = []
    engines = []
    for i, re_ in enumerate(raw_engines):
        key = f"engines[{i}]"
        e = _build(p, EngineConfig, key, re_, {
            "gpu_ids": _int_list, "cpu_cores": _int_list, "extra_args": _str_list, "env": _env})
        if e is None:
            continue
        if e.kind not in ENGINE_KINDS:
            p.add(f"{key}.kind: expected one of {', '.join(ENGINE_KINDS)}, got {e.kind!r}")
        if e.role not in ENGINE_ROLES:
            p.add(f"{key}.role: expected one of {', '.join(ENGINE_ROLES)}, got {e.role!r}")
        if e.kind == "vllm" and not e.model:
            p.add(f"{key}.model: required for kind 'vllm' (a model path or name)")
        p.check(_port, f"{key}.port", e.port, allow_zero=True)
        p.check(_port, f"{key}.nixl_side_channel_port", e.nixl_side_channel_port, allow_zero=True)
        p.check(_positive, f"{key}.kv_offload_gib", e.kv_offload_gib, allow_zero=True)
        try:
            ipaddress.ip_address(e.host)
        except ValueError:
            if e.host != "localhost":
                p.add(f"{key}.host: expected an IP address or 'localhost', got {e.host!r}")
        engines.append(e)

    from .discovery_config import parse_discovery  # it builds on this module's helpers
    discovery = parse_discovery(p, raw.get("discovery", []))

    names = [b.name for b in backends] + [e.name for e in engines if e.register]
    seen: set[str] = set()
    for n in names:
        if not n:
            p.add("backends: a backend or engine has an empty name")
        elif n in seen:
            p.add(f"backends: duplicate backend or engine name {n!r}")
        seen.add(n)
    engine_names = [e.name for e in engines]
    if len(set(engine_names)) != len(engine_names):
        p.add("engines: duplicate engine name")
    tenants = _parse_tenants(p, raw.get("tenants", []), server.api_keys if server is not None else ())
    p.raise_if_any()

    cfg = Config(server=server, routing=routing, timeouts=timeouts, health=health,
                 launcher=launcher, tracing=tracing, backends=tuple(backends), engines=tuple(engines),
                 tenants=tuple(tenants), discovery=discovery)
    # Only once everything else holds: a backend that failed to parse is not counted.
    if not any(b.decodes for b in cfg.all_backends()) and not any(d.role != "prefill" for d in discovery):
        raise ConfigError("backends: expected at least one backend (or registered engine, or [[discovery]] "
                          "table) with role 'decode' or 'both' (engine role 'consumer' or 'both')")
    return cfg


def _parse_tenants(p: _Problems, raw: Any, api_keys: tuple[str, ...]) -> list[TenantConfig]:
    if not isinstance(raw, list):
        p.add("tenants: expected an array of tables ([[tenants]])")
        return []
    out: list[TenantConfig] = []
    for i, rt in enumerate(raw):
        key = f"tenants[{i}]"
        t = _build(p, TenantConfig, key, rt)
        if t is not None:
            out.append(validate_tenant(key, t, os.environ, p.add))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        p.add("tenants: duplicate tenant name")
    keys = [t.api_key for t in out if t.api_key] + list(api_keys)
    if len(set(keys)) != len(keys):
        p.add("tenants: the same API key is given twice (tenants[].api_key, server.api_keys)")
    return out


def load_config(path: str | Path) -> Config:
    return parse_config(read_toml(path))


def read_toml(path: str | Path) -> dict[str, Any]:
    """The file's tables, before validation (router/overrides.py layers the environment on)."""
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
