"""The engines' KV-event endpoints (`--kv-events-config`), and the private directory of
the loopback engines' sockets.

An engine on a loopback host publishes its KV events on ZeroMQ ipc:// sockets (vLLM binds
ipc endpoints; a tcp one would listen on every interface), one stream and one replay socket
per engine, in `{log_dir}/kv-events` (router/config/event_sockets.py). The directory is
made with mode 0o700, so only the launcher's user can connect. When a path would not fit an
AF_UNIX address (~100 bytes), every socket goes to a fresh `mkdtemp` directory under
tempfile.gettempdir() instead (also 0o700; not derivable by `router --no-engines`).

API (used by the supervisor):

    d = EventDir(log_dir)
    d.plan(engines)            # the directory (None: no loopback engine publishes); may mkdtemp
    d.create()                 # make it (0o700), before the engines start
    d.remove_sockets(endpoints)  # unlink socket files an engine left (killed, restarted)
    d.cleanup(endpoints)       # after the engines stopped: the files, then the directory
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Iterable, Mapping, Sequence

from router.config.event_sockets import default_ipc_dir, ipc_endpoints, ipc_fits, ipc_path
from router.config.schema import EngineConfig

from .ports import EnginePorts

log = logging.getLogger("engine_launcher")

TEMP_PREFIX = "cachehit-kv-"


def kv_events_config(endpoint: str, replay_endpoint: str) -> str:
    """vLLM's `--kv-events-config` for an engine's stream and replay endpoints (both bound by
    the engine: ipc:// or tcp://*), the default topic."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
            "topic": "",
        },
        separators=(",", ":"),
    )


def event_endpoints(engine: EngineConfig, ports: EnginePorts, ipc_dir: str) -> tuple[str, str, str, str] | None:
    """(bound stream, bound replay, connected stream, connected replay) of the launcher's
    event stream for this engine; None: it has none."""
    if engine.kv_events_over_ipc:
        stream, replay = ipc_endpoints(ipc_dir, engine.name)
        return stream, replay, stream, replay
    if ports.kv_events is None or ports.kv_events_replay is None:
        return None
    stream, replay = engine.kv_event_endpoints(ports.kv_events, ports.kv_events_replay)
    return f"tcp://*:{ports.kv_events}", f"tcp://*:{ports.kv_events_replay}", stream, replay


def events_args(
    engines: Sequence[EngineConfig], ports: Mapping[str, EnginePorts], ipc_dir: str
) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """The --kv-events-config flags of these engines (one each, in order) and where the
    router connects to each."""
    argv: list[str] = []
    events: dict[str, tuple[str, str]] = {}
    for e in engines:
        eps = event_endpoints(e, ports[e.name], ipc_dir)
        if eps is not None:
            argv += ["--kv-events-config", kv_events_config(eps[0], eps[1])]
            events[e.name] = (eps[2], eps[3])
    return argv, events


def make_private_dir(path: str) -> None:
    """Create `path` with mode 0o700, or take an existing one that is a real directory of
    this user (its mode is set to 0o700); anything else is refused with OSError."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{path}: not a directory of this user; refusing to put KV-event sockets there")
    os.chmod(path, 0o700)


class EventDir:
    def __init__(self, log_dir: str) -> None:
        self.preferred = default_ipc_dir(log_dir)
        self.path: str | None = None
        self._temp = False

    def plan(self, engines: Sequence[EngineConfig]) -> str | None:
        """The directory of the engines' ipc sockets (None: no engine needs one). Idempotent."""
        names = [e.name for e in engines if e.kv_events_over_ipc]
        if not names or self.path is not None:
            return self.path
        if all(ipc_fits(ep) for n in names for ep in ipc_endpoints(self.preferred, n)):
            self.path = self.preferred
            return self.path
        self.path = tempfile.mkdtemp(prefix=TEMP_PREFIX)  # mode 0o700
        self._temp = True
        too_long = [ep for n in names for ep in ipc_endpoints(self.path, n) if not ipc_fits(ep)]
        if too_long:
            self.discard()
            raise OSError(f"KV-event socket path too long for AF_UNIX even under the temp directory: {too_long[0]}")
        log.warning(
            "KV-event sockets under %s would exceed the AF_UNIX path limit; using %s", self.preferred, self.path
        )
        return self.path

    def create(self) -> None:
        if self.path is not None:
            make_private_dir(self.path)

    @staticmethod
    def remove_sockets(endpoints: Iterable[tuple[str, str]]) -> None:
        for pair in endpoints:
            for endpoint in pair:
                path = ipc_path(endpoint)
                if path is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)

    def cleanup(self, endpoints: Iterable[tuple[str, str]]) -> None:
        """Remove the sockets, then the directory when empty (another run may share it)."""
        self.remove_sockets(endpoints)
        self.discard()

    def discard(self) -> None:
        """Remove the directory if it is empty (a planned, never started one included)."""
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
            if self._temp:
                self.path, self._temp = None, False


__all__ = ["EventDir", "event_endpoints", "events_args", "kv_events_config", "make_private_dir"]
