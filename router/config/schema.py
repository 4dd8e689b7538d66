"""router.toml's schema: the frozen dataclasses of every section, their defaults, and
`load_config` (validation by section is router/config/parse.py).

Every error names the key (dotted path, with list indexes) and what was expected, so
`router check-config` and a failed start tell the user exactly what to fix.
Defaults are safe: listen on loopback, bounded bodies, bounded concurrency, timeouts on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from router.config.event_sockets import default_ipc_dir, ipc_endpoints, ipc_fits
from router.config.launch import KV_EVENTS_FLAG as KV_EVENTS_FLAG  # re-exported
from router.config.launch import EngineConfig as EngineConfig  # re-exported
from router.config.launch import LauncherConfig as LauncherConfig  # re-exported
from router.names import Role, SplitMode


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


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Client keys (Authorization: Bearer). Empty: no authentication.
    api_keys: tuple[str, ...] = ()
    # Key for admin routes (/admin/*). Empty: admin routes disabled.
    admin_api_key: str = ""
    max_body_bytes: int = 4 * 1024 * 1024
    # The bytes of request bodies held at once (Content-Length; max_body_bytes for a body
    # without one): a request in flight costs up to ~20x its body (docs/RELIABILITY.md),
    # so this bounds the router's memory whatever the bodies' sizes; past it requests wait
    # (queue_timeout_s, then 429).
    max_body_bytes_in_flight: int = 64 * 1024 * 1024
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
    # Longest time to receive a request's head (request line and headers), from the
    # connection's start or the first byte after the previous answer; past it the
    # connection gets 408 and is closed (nginx client_header_timeout, Envoy
    # request_headers_timeout).
    header_timeout_s: float = 10.0
    # Largest request head (request line and headers together); past it: 431 and close.
    # (aiohttp also holds each line to 8190 bytes and a head to 128 headers.)
    max_header_bytes: int = 64 * 1024
    # An idle keep-alive connection is closed after this long (nginx keepalive_timeout 75 s).
    keepalive_timeout_s: float = 75.0
    # Per stream: bytes the router holds for a client that reads slower than the engine
    # writes before it stops reading the engine (backpressure through the engine's socket).
    stream_buffer_bytes: int = 8 * 1024
    # Per engine leg: how much is read at a time (aiohttp's buffer, the socket's receive
    # buffer), so an answer the engine sends at once arrives in a few large reads.
    engine_read_bytes: int = 64 * 1024
    tls_cert: str = ""
    tls_key: str = ""
    log_level: str = "info"
    # One log line per request at INFO (router/observability/logs.py); false keeps the
    # router's other INFO lines and drops these (~5 us of CPU a request).
    request_log: bool = True
    # json: one JSON object per line (log shippers); text: for humans (router/observability/logs.py).
    log_format: str = "json"
    # SO_REUSEPORT on the listening socket: N router processes on one host share the port
    # (the kernel spreads connections over them); see docs/ARCHITECTURE.md.
    reuse_port: bool = False


@dataclass(frozen=True)
class RoutingConfig:
    """The `[routing]` keys the request pipeline reads. A policy's own keys (the probe's
    threshold, race mode, deadline, probe bounds) stay in `policy_keys` as written, and the
    policy parses and checks them into its own settings (router/routing/policies/)."""

    # A policy's registered name (router/routing/policies/; checked by the registry).
    strategy: str = "probe"
    # Threshold sent on decode legs (after a prefill, or when resuming); a small guard
    # lets a decode engine that lost the cache (preemption) hand the request back.
    decode_guard_threshold: float = 0.0
    # Prompts shorter than this never go prefill/decode (an operator's floor; above it the
    # cost model decides whether a split is faster).
    min_pd_prompt_tokens: int = 256
    # "auto": a prompt nobody accepted is computed where the cost model predicts the most
    # requests, new and running, stay within both SLOs below (goodput), then the least
    # TTFT; "always": split whenever a producer is available and the prompt is over
    # min_pd_prompt_tokens; "never": always computed on a decoder.
    split: SplitMode = SplitMode.AUTO
    # Goodput's SLOs (docs/CONFIG.md): time to first token, and the gap between tokens.
    slo_ttft_ms: float = 2000.0
    slo_itl_ms: float = 100.0
    # A request predicted to miss its TTFT SLO wherever it goes waits at most this many
    # times its soonest predicted start (router/routing/goodput.py `best`); 0: no bound
    # (the most goodput; a bound trades much of it for a shorter tail: docs/CONFIG.md).
    max_ttft_stretch: float = 0.0
    # Such a request may be split through an idle producer while another stays idle
    # (router/routing/goodput.py `spare_producers`): no queue on a decoder, no stalls. It pays
    # where the producers could take every prompt and costs goodput where they could not:
    # "auto" while the prompt work placed lately is within the producers' measured speed,
    # "always", "never" (docs/CONFIG.md).
    spare_producers: SplitMode = SplitMode.AUTO
    # The engines' prefill chunk (vLLM's max_num_batched_tokens): a prefill computed on a
    # decoder stalls each of its steps by at most this many tokens' worth.
    prefill_chunk_tokens: int = 8192
    # Where the cost model's measured engine speeds start (router/routing/speed_learner.py); the
    # router replaces them with measurements after a few requests per engine.
    prior_prefill_tokens_per_s: float = 10000.0
    prior_kv_transfer_tokens_per_s: float = 100000.0
    max_resumes: int = 3
    # Retries on another backend for failures before the first token.
    max_retries: int = 2
    # The prefix memory's budget (router/routing/prefix_memory.py): where the router sent
    # which prompt prefixes, shared fairly between tenants.
    prefix_memory_bytes: int = 64 * 1024 * 1024
    # LoRA adapters the router may have engines load (router/fleet/adapters.py), name ->
    # path on the engines' hosts ([routing.lora_adapters]): the only paths ever sent to an
    # engine's /v1/load_lora_adapter; a client names an adapter, never a path.
    lora_adapters: tuple[tuple[str, str], ...] = ()
    # A request for one of them that no engine holds loads it on the engine the cost model
    # picks (the engines need VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
    lora_autoload: bool = False
    # Adapters the router loads on one engine at most (vLLM's --max-cpu-loras bounds its own).
    max_adapters_per_engine: int = 4
    # The other [routing] keys as (key, value) pairs, sorted: the policies' own.
    policy_keys: tuple[tuple[str, Any], ...] = ()


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
    # An engine whose answers stall (first tokens or health checks far later than
    # predicted) is avoided this long, twice as long each time it stalls again (up to
    # 60 s; router/fleet/stalls.py). 0: never.
    slow_engine_s: float = 5.0


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry spans over OTLP/HTTP (router/observability/tracing.py); needs the `tracing` extra."""

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
    role: Role = Role.DECODE
    # Served model names. Empty: discovered from the backend's /v1/models.
    models: tuple[str, ...] = ()
    # Sent upstream as Authorization: Bearer; never taken from clients.
    api_key: str = ""
    # Expected prefill speed of this engine (its hardware), where the cost model's fit of
    # it starts; 0: routing.prior_prefill_tokens_per_s. Measurements replace it.
    prefill_tokens_per_s: float = 0.0
    # Its prefill chunk (vLLM --max-num-batched-tokens) where it differs from the fleet's
    # (routing.prefill_chunk_tokens; 0: that): e.g. decoders with a small chunk, whose steps
    # stall their sequences less, and producers with a large one, whose steps stall nobody.
    prefill_chunk_tokens: int = 0
    # The engine's KV-event stream (vLLM --kv-events-config: its ZMQ PUB endpoint, replay
    # ROUTER endpoint and topic); empty: not subscribed (router/fleet/kv_events.py).
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    # DP ranks behind this one address (vLLM --data-parallel-size): each rank is its own
    # engine to the router (router/config/data_parallel.py), reached with vLLM's
    # X-data-parallel-rank header. 1: one engine.
    data_parallel_size: int = 1
    # The one rank this backend is (set by the expansion; -1: no rank targeting).
    data_parallel_rank: int = -1

    @property
    def decodes(self) -> bool:
        return self.role in (Role.DECODE, Role.BOTH)

    @property
    def prefills(self) -> bool:
        return self.role in (Role.PREFILL, Role.BOTH)


# The X-Request-Priority range (router/admission/tenants.py); a tenant's max_priority lies in it.
MIN_PRIORITY, MAX_PRIORITY = -100, 100


@dataclass(frozen=True)
class TenantConfig:
    name: str
    api_key: str = ""
    # Name of an environment variable holding the key (read at start).
    api_key_env: str = ""
    max_concurrent_requests: int = 0  # 0: only the server's limit
    max_queued_requests: int = 0  # 0: as many as max_concurrent_requests (or the server's queue)
    requests_per_s: float = 0.0  # 0: no rate limit
    burst: int = 0  # 0: max(1, requests_per_s rounded up)
    max_priority: int = 0


SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class DiscoveryConfig:
    kind: str = "dns"
    # kind dns: the name to resolve.
    name: str = ""
    # Engine port on every address found (kind kubernetes: the container port, by number).
    port: int = 8000
    role: Role = Role.DECODE
    # Served model names; empty: read from each engine's /v1/models.
    models: tuple[str, ...] = ()
    # Seconds between two look-ups.
    interval_s: float = 10.0
    scheme: str = "http"
    # Sent to the engines found as Authorization: Bearer.
    api_key: str = ""
    # kind dns: "ip" or "ip:port" ("[v6]:port") of the DNS servers; empty: the system's.
    nameservers: tuple[str, ...] = ()
    # kind kubernetes.
    namespace: str = ""  # empty: the router pod's own namespace
    label_selector: str = ""
    api_server: str = ""  # empty: in-cluster (KUBERNETES_SERVICE_HOST / _PORT)
    token_file: str = f"{SERVICE_ACCOUNT}/token"
    ca_file: str = f"{SERVICE_ACCOUNT}/ca.crt"
    # The engines' KV-event ports on each address found (0: not subscribed).
    kv_events_port: int = 0
    kv_events_replay_port: int = 0
    kv_events_topic: str = ""

    @property
    def source(self) -> str:
        """The fleet source name of this table's backends (stable across reloads)."""
        return f"discovery:{self.kind}:{self.name or self.label_selector}"


@dataclass(frozen=True)
class KvEventsConfig:
    """The index of the engines' KV-event streams (router/routing/kv_index.py)."""

    # Blocks kept per engine (per data-parallel rank); past it the oldest go.
    max_blocks_per_engine: int = 262_144
    # A stream whose last batch was this late, or silent this long while the engine works,
    # is reported as not fresh.
    stale_after_s: float = 10.0


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
    # Client keys with limits of their own (router/admission/tenants.py).
    tenants: tuple[TenantConfig, ...] = ()
    discovery: tuple[DiscoveryConfig, ...] = ()  # router/config/discovery.py
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)  # router/config/kv_events.py

    def all_backends(
        self,
        engine_urls: dict[str, str] | None = None,
        kv_event_endpoints: dict[str, tuple[str, str]] | None = None,
    ) -> tuple[BackendConfig, ...]:
        """Backends declared directly plus registered engines.

        engine_urls maps an engine name to its actual URL once the launcher picked a port;
        kv_event_endpoints an engine name to its (stream, replay) endpoints once it started
        them. Without the latter (engines started elsewhere): a loopback engine's ipc://
        sockets under launcher.log_dir (when they fit an AF_UNIX path), another engine's
        configured kv_events_port/kv_events_replay_port, when set.
        """
        out = list(self.backends)
        for e in self.engines:
            if not e.register:
                continue
            url = (engine_urls or {}).get(e.name) or f"http://{e.host}:{e.port}"
            models = (e.served_model_name or e.model,) if (e.served_model_name or e.model) else ()
            events, replay = "", ""
            if kv_event_endpoints is not None:
                events, replay = kv_event_endpoints.get(e.name, ("", ""))
            elif e.kv_events_over_ipc:
                pair = ipc_endpoints(default_ipc_dir(self.launcher.log_dir), e.name)
                if all(ipc_fits(ep) for ep in pair):
                    events, replay = pair
            elif e.kv_events and e.kv_events_port:
                events, replay = e.kv_event_endpoints(e.kv_events_port, e.kv_events_replay_port)
            out.append(
                BackendConfig(
                    name=e.name,
                    url=url,
                    role=e.backend_role,
                    models=models,
                    kv_events_endpoint=events,
                    kv_events_replay_endpoint=replay,
                )
            )
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
        d["routing"].update(d["routing"].pop("policy_keys"))
        return d
