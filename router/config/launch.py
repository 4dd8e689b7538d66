"""The `[[engines]]` and `[launcher]` sections of router.toml: the engines the router's
launcher starts itself (docs/LAUNCHER.md), and where their KV-event streams are published.
Re-exported by router/config/schema.py with the rest of the schema."""

from __future__ import annotations

from dataclasses import dataclass

from router.config.event_sockets import has_flag, is_loopback_host
from router.names import EngineRole, Role

KV_EVENTS_FLAG = "--kv-events-config"


@dataclass(frozen=True)
class EngineConfig:
    """An engine the launcher starts (kind sim or vllm)."""

    name: str
    kind: str  # an EngineKind
    role: EngineRole = EngineRole.BOTH
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
    # Its KV-event stream (vLLM --kv-events-config): published by the engine and followed by
    # the router. A loopback host publishes on ipc:// sockets in {log_dir}/kv-events; the
    # ports (0: free ones picked at start) are for any other host (docs/LAUNCHER.md).
    kv_events: bool = True
    kv_events_port: int = 0
    kv_events_replay_port: int = 0

    @property
    def backend_role(self) -> Role:
        """An engine's role in the launcher maps to the router-side backend role."""
        return EngineRole(self.role).backend_role

    @property
    def launcher_kv_events(self) -> bool:
        """Whether the launcher sets up this engine's event stream (a user's own flag wins)."""
        return self.kv_events and not has_flag(self.extra_args, KV_EVENTS_FLAG)

    @property
    def kv_events_over_ipc(self) -> bool:
        """The launcher's stream of a loopback engine: ipc:// sockets, no TCP port."""
        return self.launcher_kv_events and is_loopback_host(self.host)

    @property
    def kv_events_over_tcp(self) -> bool:
        return self.launcher_kv_events and not is_loopback_host(self.host)

    def kv_event_endpoints(self, port: int, replay_port: int) -> tuple[str, str]:
        """Where the router connects to the tcp stream and replay sockets on these ports (an
        engine on a non-loopback host): the engine's host (the engine binds every interface,
        vLLM binds only wildcards), through loopback for a wildcard host. A replay port 0
        gives no replay endpoint."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        return f"tcp://{host}:{port}", f"tcp://{host}:{replay_port}" if replay_port else ""


@dataclass(frozen=True)
class LauncherConfig:
    log_dir: str = "engine-logs"
    startup_timeout_s: float = 300.0
    max_restarts: int = 5
    restart_backoff_s: float = 1.0
