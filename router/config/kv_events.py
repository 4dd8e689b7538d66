"""The KV-event keys: `[kv_events]`, the stream endpoints of `[[backends]]` and
`[[discovery]]` tables, and the event ports of `[[engines]]` (docs/CONFIG.md). The endpoints come only from the operator's
configuration (or the admin API), never from a client request."""

from __future__ import annotations

from typing import Any

from router.config.checks import Problems, build_table, check_port, check_positive
from router.config.event_sockets import is_loopback_host, vllm_data_parallel_flag
from router.config.schema import BackendConfig, ConfigError, DiscoveryConfig, EngineConfig, KvEventsConfig


def check_zmq_endpoint(key: str, value: str) -> None:
    """A ZMQ endpoint the router connects to: tcp://host:port or ipc://path."""
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return
    host, sep, port = value.removeprefix("tcp://").rpartition(":")
    if not value.startswith("tcp://") or not sep or not host or "*" in host or not port.isdigit():
        raise ConfigError(f"{key}: expected tcp://host:port or ipc://path (an engine's address), got {value!r}")
    check_port(key, int(port), allow_zero=False)


def check_backend_kv_events(p: Problems, key: str, b: BackendConfig) -> None:
    if b.kv_events_endpoint:
        p.check(check_zmq_endpoint, f"{key}.kv_events_endpoint", b.kv_events_endpoint)
    if b.kv_events_replay_endpoint:
        p.check(check_zmq_endpoint, f"{key}.kv_events_replay_endpoint", b.kv_events_replay_endpoint)
        if not b.kv_events_endpoint:
            p.add(f"{key}.kv_events_replay_endpoint: needs kv_events_endpoint (the stream it replays)")


def check_discovery_kv_events(p: Problems, key: str, d: DiscoveryConfig) -> None:
    p.check(check_port, f"{key}.kv_events_port", d.kv_events_port, allow_zero=True)
    p.check(check_port, f"{key}.kv_events_replay_port", d.kv_events_replay_port, allow_zero=True)
    if d.kv_events_replay_port and not d.kv_events_port:
        p.add(f"{key}.kv_events_replay_port: needs kv_events_port (the stream it replays)")


def check_engine_kv_events(p: Problems, key: str, e: EngineConfig) -> None:
    p.check(check_port, f"{key}.kv_events_port", e.kv_events_port, allow_zero=True)
    p.check(check_port, f"{key}.kv_events_replay_port", e.kv_events_replay_port, allow_zero=True)
    for port_key in ("kv_events_port", "kv_events_replay_port"):
        if not e.kv_events and getattr(e, port_key):
            p.add(f"{key}.{port_key}: set while kv_events = false (the engine publishes no events)")
    if e.kv_events_port and e.kv_events_port == e.kv_events_replay_port:
        p.add(f"{key}.kv_events_replay_port: the same port as kv_events_port ({e.kv_events_port})")
    if e.kv_events and is_loopback_host(e.host):
        for port_key in ("kv_events_port", "kv_events_replay_port"):
            if getattr(e, port_key):
                p.add(
                    f"{key}.{port_key}: host {e.host!r} is loopback, so the engine publishes its KV "
                    f"events on ipc:// sockets in the launcher's log_dir, not on a TCP port (a tcp "
                    f"stream would listen on every interface); remove the key, or set a "
                    f"non-loopback host"
                )
    if e.kind == "vllm" and e.kv_events_over_ipc:
        flag = vllm_data_parallel_flag(e.extra_args)
        if flag is not None:
            p.add(
                f"{key}.extra_args: {flag} gives data-parallel ranks other than 0, and vLLM 0.32 "
                f"cannot give those ranks their own ipc:// KV-event sockets (host {e.host!r} is "
                f"loopback); set kv_events = false, or pass your own --kv-events-config"
            )


def parse_kv_events(p: Problems, raw: Any) -> KvEventsConfig | None:
    kv = build_table(p, KvEventsConfig, "kv_events", raw)
    if kv is not None:
        p.check(check_positive, "kv_events.max_blocks_per_engine", kv.max_blocks_per_engine)
        p.check(check_positive, "kv_events.stale_after_s", kv.stale_after_s)
    return kv
