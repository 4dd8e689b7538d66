"""Engines the router starts from `[[engines]]` (the real launcher, simulated engines)
publish KV events, and the router follows each at the endpoints the launcher picked: for
engines on a loopback host, ipc sockets in a private directory, no TCP port."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import psutil

from engine_launcher.supervisor import Supervisor
from router.config.parse import parse_config
from router.server.state import RouterState
from support.polling import eventually

MODEL = "sim-model"
# Liveness bound for a loaded machine (engines start, a stream answers), not a speed check.
WAIT_S = 60.0


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def exists(path: str) -> bool:
    return os.path.lexists(path)


def listening_tcp_ports(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


async def test_started_engines_are_followed_at_the_endpoints_the_launcher_picked(tmp_path: Path) -> None:
    sim = {"kind": "sim", "role": "both", "model": MODEL}
    raw = {
        "launcher": {"log_dir": str(tmp_path / "logs"), "startup_timeout_s": WAIT_S},
        "engines": [
            {"name": "a", **sim},
            {"name": "b", **sim},  # shares a's process: one stream each all the same
            {"name": "quiet", **sim, "kv_events": False},
        ],
    }
    state = RouterState(parse_config(raw))
    await state.start()
    try:
        assert state.supervisor is not None
        assert state.registry is not None
        assert state.kv_events is not None
        endpoints = state.supervisor.kv_event_endpoints()
        assert set(endpoints) == {"a", "b"}
        for name, (stream, replay) in endpoints.items():
            c = state.registry.states[name].config
            assert (c.kv_events_endpoint, c.kv_events_replay_endpoint) == (stream, replay)
        # Loopback engines: ipc sockets of their own in the launcher's private directory.
        d = str(tmp_path / "logs" / "kv-events")
        assert endpoints == {n: (f"ipc://{d}/{n}.events", f"ipc://{d}/{n}.replay") for n in ("a", "b")}
        assert mode(d) == 0o700
        paths = [ep.removeprefix("ipc://") for pair in endpoints.values() for ep in pair]
        assert state.registry.states["quiet"].config.kv_events_endpoint == ""
        assert set(state.kv_events.streams) == {"a", "b"}
        # Each stream's replay socket answered: the router is connected to the engine itself.
        streams = state.kv_events.streams
        await eventually(lambda: all(s.synced for s in streams.values()), WAIT_S, "every stream synced")

        # A prompt computed on b reaches the index through b's stream, and only b's.
        url = state.registry.states["b"].config.url
        body = {"model": MODEL, "prompt": "the quick brown fox " * 40, "max_tokens": 2}
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        index = state.kv_events.index
        await eventually(lambda: index.stats("b").blocks > 0, WAIT_S, "b's blocks indexed")
        assert index.stats("a").blocks == 0

        # Nothing listens on TCP but the engines' HTTP ports: no event stream on any interface.
        http = {urlsplit(state.registry.states[n].config.url).port for n in ("a", "b", "quiet")}
        assert isinstance(state.supervisor, Supervisor)  # the launcher, through its entry point
        pids = {u.pid for u in state.supervisor.status()}
        assert None not in pids
        assert set().union(*(listening_tcp_ports(p) for p in pids if p is not None)) == http
    finally:
        await state.stop()
    # Stopped: no socket file and no directory left.
    assert not any(map(exists, paths))
    assert not exists(d)
