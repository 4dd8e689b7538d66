"""Where a launched engine on a loopback host publishes its KV events: ZeroMQ ipc:// sockets
in a private directory, never a TCP port (docs/LAUNCHER.md, "KV cache events").

vLLM binds a KV-event endpoint only when it is a wildcard tcp address or an ipc/inproc one
(it connects to any other), so a tcp stream of an engine on 127.0.0.1 would listen on every
interface. The launcher and the router (`router --no-engines`) derive the same paths from
the launcher's `log_dir`; both sides use these pure functions.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re

IPC_PREFIX = "ipc://"
# The sockets' directory under the launcher's log_dir (created with mode 0o700).
IPC_DIR_NAME = "kv-events"
# AF_UNIX socket paths: sun_path holds 108 bytes on Linux, 104 on macOS, NUL included.
MAX_IPC_PATH_BYTES = 100

_SAFE_STEM = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,39}")
_VLLM_DP_FLAGS = {"--data-parallel-size": 1, "-dp": 1, "--data-parallel-start-rank": 0, "-dpr": 0}


def is_loopback_host(host: str) -> bool:
    """localhost or a loopback address (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_ipc_dir(log_dir: str) -> str:
    """The sockets' directory for a launcher log_dir (made absolute: the working directory)."""
    return os.path.join(os.path.abspath(log_dir), IPC_DIR_NAME)


def socket_stem(engine_name: str) -> str:
    """A file name stem for an engine: its name when short and plain, else a digest of it."""
    if _SAFE_STEM.fullmatch(engine_name):
        return engine_name
    return "engine-" + hashlib.sha256(engine_name.encode()).hexdigest()[:16]


def ipc_endpoints(directory: str, engine_name: str) -> tuple[str, str]:
    """An engine's (stream, replay) ipc:// endpoints in `directory`: bound by the engine,
    connected to by the router (the same strings)."""
    stem = os.path.join(directory, socket_stem(engine_name))
    return f"{IPC_PREFIX}{stem}.events", f"{IPC_PREFIX}{stem}.replay"


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ipc:// endpoint (None for any other transport)."""
    return endpoint[len(IPC_PREFIX) :] if endpoint.startswith(IPC_PREFIX) else None


def ipc_fits(endpoint: str) -> bool:
    path = ipc_path(endpoint)
    return path is not None and len(os.fsencode(path)) <= MAX_IPC_PATH_BYTES


def has_flag(args: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def vllm_data_parallel_flag(args: tuple[str, ...]) -> str | None:
    """The extra_args flag giving a vLLM engine data-parallel ranks other than 0, if any:
    vLLM 0.32 offsets only tcp and inproc event endpoints per rank (an ipc one is refused)."""
    for i, a in enumerate(args):
        name, sep, value = a.partition("=")
        if name not in _VLLM_DP_FLAGS:
            continue
        if not sep:
            value = args[i + 1] if i + 1 < len(args) else ""
        if value.isdigit() and int(value) > _VLLM_DP_FLAGS[name]:
            return name
    return None


__all__ = [
    "IPC_DIR_NAME",
    "MAX_IPC_PATH_BYTES",
    "default_ipc_dir",
    "has_flag",
    "ipc_endpoints",
    "ipc_fits",
    "ipc_path",
    "is_loopback_host",
    "socket_stem",
    "vllm_data_parallel_flag",
]
