"""Engine ports: which ones the config leaves to pick, picking and holding free ones, the
resolved set per engine, clash checks, and the base URL an engine is reached at.

Ports per engine: HTTP; the NIXL side channel (vllm); the KV-event stream and its replay
socket (every engine with `kv_events` on a non-loopback host, unless its extra_args bring
their own `--kv-events-config`; a loopback engine publishes on ipc:// sockets instead,
event_dir.py). The event sockets bind every interface (vLLM binds only wildcard tcp
endpoints), so their free ports are picked on the wildcard address.

Everything but `PortReservation` is a pure function of the config.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.config.schema import ConfigError, EngineConfig

WILDCARD = "0.0.0.0"


@dataclass(frozen=True)
class EnginePorts:
    """Resolved ports of one engine: HTTP, the NIXL side channel (vllm only), the KV-event
    stream and its replay socket (None: no tcp event stream, see EngineConfig.kv_events_over_tcp)."""

    http: int
    nixl: int | None = None
    kv_events: int | None = None
    kv_events_replay: int | None = None


def publishes_kv_events(engine: EngineConfig) -> bool:
    """Whether the launcher gives this engine an event stream (a user's own flag wins)."""
    return engine.launcher_kv_events


def url_for(host: str, port: int) -> str:
    """Base URL to reach an engine listening on host:port (wildcards reached via loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def check_ports(engines: Sequence[EngineConfig], ports: Mapping[str, EnginePorts]) -> None:
    """Every engine has ports, and no two listeners share a port (a clash names the key)."""
    seen: dict[int, str] = {}
    for i, e in enumerate(engines):
        p = ports.get(e.name)
        if p is None:
            raise ValueError(f"no ports resolved for engine {e.name!r}")
        pairs: list[tuple[str, int | None]] = [(f"engines[{i}].port", p.http)]
        if e.kind == "vllm":
            pairs.append((f"engines[{i}].nixl_side_channel_port", p.nixl))
        if e.kv_events_over_tcp:
            pairs.append((f"engines[{i}].kv_events_port", p.kv_events))
            pairs.append((f"engines[{i}].kv_events_replay_port", p.kv_events_replay))
        for key, port in pairs:
            if port is None or port <= 0:
                raise ValueError(f"{key}: port not resolved for engine {e.name!r}")
            if port in seen:
                raise ConfigError(f"{key}: port {port} is already used by {seen[port]}")
            seen[port] = key


def ports_to_pick(engines: Sequence[EngineConfig]) -> list[tuple[str, str, str]]:
    """(engine name, "http" | "nixl" | "kv_events" | "kv_events_replay", bind host) for every
    port the config leaves at 0."""
    out = []
    for e in engines:
        if e.port == 0:
            out.append((e.name, "http", e.host))
        if e.kind == "vllm" and e.nixl_side_channel_port == 0:
            out.append((e.name, "nixl", e.nixl_side_channel_host))
        if e.kv_events_over_tcp:
            if e.kv_events_port == 0:
                out.append((e.name, "kv_events", WILDCARD))
            if e.kv_events_replay_port == 0:
                out.append((e.name, "kv_events_replay", WILDCARD))
    return out


def resolve_ports(
    engines: Sequence[EngineConfig], picked: Mapping[tuple[str, str], int] | None = None
) -> dict[str, EnginePorts]:
    """Configured ports, with the zeros filled from `picked[(name, which)]` (ports_to_pick)."""
    picked = picked or {}
    out = {}
    for e in engines:
        http = e.port or picked.get((e.name, "http"), 0)
        nixl = events = replay = None
        if e.kind == "vllm":
            nixl = e.nixl_side_channel_port or picked.get((e.name, "nixl"), 0)
        if e.kv_events_over_tcp:
            events = e.kv_events_port or picked.get((e.name, "kv_events"), 0)
            replay = e.kv_events_replay_port or picked.get((e.name, "kv_events_replay"), 0)
        out[e.name] = EnginePorts(http=http, nixl=nixl, kv_events=events, kv_events_replay=replay)
    return out


class PortReservation:
    """Free ports picked by binding port 0 and kept bound until released.

    Holding every picked socket until its engine is spawned makes the picks distinct and
    keeps other programs off them in the meantime; the socket never listens, so releasing
    it leaves no TIME_WAIT behind and the engine binds the port at once.
    """

    def __init__(self) -> None:
        self._socks: dict[tuple[str, str], socket.socket] = {}
        self.picked: dict[tuple[str, str], int] = {}

    def pick(self, engine: str, which: str, host: str) -> int:
        bind_host = "127.0.0.1" if host == "localhost" else host
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.bind((bind_host, 0))
        except OSError:
            # Not an address of this machine (e.g. a NIXL side-channel host advertised through
            # NAT): any interface's free port will do.
            s.close()
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        port: int = s.getsockname()[1]
        self._socks[(engine, which)] = s
        self.picked[(engine, which)] = port
        return port

    def release(self, engines: Sequence[str]) -> None:
        for key in [k for k in self._socks if k[0] in engines]:
            self._socks.pop(key).close()

    def release_all(self) -> None:
        for s in self._socks.values():
            s.close()
        self._socks.clear()


__all__ = [
    "EnginePorts",
    "PortReservation",
    "check_ports",
    "ports_to_pick",
    "publishes_kv_events",
    "resolve_ports",
    "url_for",
]
