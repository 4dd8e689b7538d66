"""Engine ports (which are picked, resolving, clashes, URLs) and the KV-event streams of
launched engines: their ports, the `--kv-events-config` each engine gets, and a started
simulator publishing where the supervisor says it does."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest
import zmq
import zmq.asyncio

from engine_launcher.commands import build_commands
from engine_launcher.host import HostInfo
from engine_launcher.ports import EnginePorts, ports_to_pick, resolve_ports, url_for
from engine_launcher.supervisor import Supervisor
from router.config.parse import parse_config
from router.config.schema import ConfigError, EngineConfig, LauncherConfig
from router.names import EngineRole

CPU_HOST = HostInfo(gpu_count=0, cpu_ids=(0, 1))
ANY = "0.0.0.0"
# The replay protocol's end marker: seq -1 (vLLM's, docs/SIMULATOR.md).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Hang guard for a reply (not a timing assertion: the answer takes milliseconds).
REPLY_TIMEOUT_S = 30


def sim(name: str, **kw: Any) -> EngineConfig:
    return EngineConfig(name=name, kind="sim", role=EngineRole.BOTH, model="m", **kw)


def vllm(name: str, **kw: Any) -> EngineConfig:
    return EngineConfig(name=name, kind="vllm", role=EngineRole.BOTH, model="/models/tiny", **kw)


def picked_for(engines: list[EngineConfig], base: int = 40000) -> dict[tuple[str, str], int]:
    """Distinct made-up picks for every port the engines leave at 0."""
    return {(name, which): base + i for i, (name, which, _) in enumerate(ports_to_pick(engines))}


def flag_values(argv: tuple[str, ...]) -> list[dict[str, Any]]:
    return [json.loads(argv[i + 1]) for i, a in enumerate(argv) if a == "--kv-events-config"]


def test_port_assignment_fills_only_zeros_and_clashes_name_the_key() -> None:
    engines = [
        vllm("v", port=8000, host="10.0.0.5"),
        EngineConfig(name="s", kind="sim", port=0),
        vllm("w", nixl_side_channel_port=5700, host="0.0.0.0"),
    ]
    assert ports_to_pick(engines) == [
        ("v", "nixl", "127.0.0.1"),
        # Event sockets bind every interface: their free ports are picked on the wildcard.
        ("v", "kv_events", "0.0.0.0"),
        ("v", "kv_events_replay", "0.0.0.0"),
        # A loopback engine publishes on ipc sockets: no event port.
        ("s", "http", "127.0.0.1"),
        ("w", "http", "0.0.0.0"),
        ("w", "kv_events", "0.0.0.0"),
        ("w", "kv_events_replay", "0.0.0.0"),
    ]
    ports = resolve_ports(engines, picked_for(engines, 41000))
    assert ports == {
        "v": EnginePorts(8000, 41000, 41001, 41002),
        "s": EnginePorts(41003, None, None, None),
        "w": EnginePorts(41004, 5700, 41005, 41006),
    }
    clash = [
        vllm("v", port=8000, nixl_side_channel_port=5600),
        vllm("w", port=8001, nixl_side_channel_port=8000),
    ]
    with pytest.raises(ConfigError, match=r"engines\[1\]\.nixl_side_channel_port: port 8000"):
        build_commands(clash, resolve_ports(clash, picked_for(clash)), CPU_HOST, log_dir="l")


def test_unresolved_port_is_refused() -> None:
    engines = [EngineConfig(name="s", kind="sim")]
    with pytest.raises(ValueError, match="not resolved"):
        build_commands(engines, resolve_ports(engines), CPU_HOST, log_dir="l")


def test_url_for_wildcards_and_ipv6() -> None:
    assert url_for("0.0.0.0", 1) == "http://127.0.0.1:1"
    assert url_for("::", 2) == "http://[::1]:2"
    assert url_for("::1", 3) == "http://[::1]:3"
    assert url_for("localhost", 4) == "http://localhost:4"


def test_configured_ports_of_non_loopback_hosts_are_bound_on_the_wildcard_and_reached_at_the_host() -> None:
    engines = [
        vllm(
            "v",
            host="10.0.0.5",
            port=8000,
            nixl_side_channel_port=5600,
            kv_events_port=5557,
            kv_events_replay_port=5558,
        ),
        sim("s", port=8001, host="0.0.0.0", kv_events_port=5559, kv_events_replay_port=5560),
    ]
    assert ports_to_pick(engines) == []
    ports = resolve_ports(engines)
    assert ports["v"] == EnginePorts(8000, 5600, 5557, 5558)
    v, s = build_commands(engines, ports, CPU_HOST, log_dir="l")
    # vLLM binds only wildcard tcp endpoints (it connects to any other): both on tcp://*.
    assert flag_values(v.argv) == [
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": "",
        }
    ]
    assert flag_values(s.argv)[0]["endpoint"] == "tcp://*:5559"
    assert dict(v.kv_events) == {"v": ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")}
    # A wildcard engine host is reached through loopback, as its HTTP port is.
    assert dict(s.kv_events) == {"s": ("tcp://127.0.0.1:5559", "tcp://127.0.0.1:5560")}


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_a_loopback_engine_publishes_on_ipc_sockets_of_its_own(host: str) -> None:
    engines = [vllm("v", host=host, port=8000, nixl_side_channel_port=5600), sim("s", host=host, port=8001)]
    assert ports_to_pick(engines) == []
    v, s = build_commands(engines, resolve_ports(engines), CPU_HOST, log_dir="l")
    d = os.path.join(os.path.abspath("l"), "kv-events")
    for cmd, name in ((v, "v"), (s, "s")):
        (flag,) = flag_values(cmd.argv)
        pair = (f"ipc://{d}/{name}.events", f"ipc://{d}/{name}.replay")
        assert (flag["endpoint"], flag["replay_endpoint"]) == pair
        # The router connects to the very paths the engine binds.
        assert dict(cmd.kv_events) == {name: pair}


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (
            {"name": "e", "kind": "sim", "kv_events_port": 5557},
            r"engines\[0\]\.kv_events_port: host '127.0.0.1' is loopback",
        ),
        (
            {"name": "e", "kind": "sim", "host": "localhost", "kv_events_replay_port": 5558},
            r"engines\[0\]\.kv_events_replay_port: host 'localhost' is loopback",
        ),
        (
            {"name": "e", "kind": "vllm", "model": "m", "extra_args": ["--data-parallel-size", "2"]},
            r"engines\[0\]\.extra_args: --data-parallel-size gives data-parallel ranks",
        ),
    ],
)
def test_event_ports_on_a_loopback_host_are_refused_naming_the_key(engine: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"engines": [engine]})


def test_no_events_when_turned_off_or_brought_by_the_users_own_flag() -> None:
    own = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}'
    engines = [
        sim("off", port=9000, kv_events=False),
        vllm("own", port=9001, nixl_side_channel_port=9002, extra_args=("--kv-events-config", own)),
    ]
    # Nothing to pick, check or report: the user's stream is theirs.
    assert ports_to_pick(engines) == []
    ports = resolve_ports(engines)
    assert ports["off"] == EnginePorts(9000)
    off, mine = build_commands(engines, ports, CPU_HOST, log_dir="l")
    assert "--kv-events-config" not in off.argv
    assert flag_values(mine.argv) == [json.loads(own)]
    assert dict(off.kv_events) == dict(mine.kv_events) == {}


def test_plan_picks_distinct_free_event_ports_and_holds_them(tmp_path: Path) -> None:
    engines = [sim(f"s{i}", host=ANY) for i in range(3)] + [vllm("v", host=ANY), sim("local")]
    sup = Supervisor(engines, LauncherConfig(log_dir=str(tmp_path)), host_has_gpu=False)
    try:
        cmds = sup.plan()
        ports = sup.ports
        picked = [p for e in ports.values() for p in (e.http, e.nixl, e.kv_events, e.kv_events_replay) if p]
        # The loopback engine has an HTTP port only.
        assert len(picked) == len(set(picked)) == 3 * 3 + 4 + 1
        assert ports["local"].kv_events is None
        # Held until the engine is spawned: nobody else binds them meanwhile.
        pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        try:
            with pytest.raises(zmq.ZMQError, match="in use"):
                pub.bind(f"tcp://*:{ports['s1'].kv_events}")
        finally:
            pub.close(linger=0)
        # The three identical simulators share a process, one stream each in --port order.
        sims = next(c for c in cmds if c.kind == "sim")
        assert [f["endpoint"] for f in flag_values(sims.argv)] == [
            f"tcp://*:{ports[f's{i}'].kv_events}" for i in range(3)
        ]
        d = tmp_path / "kv-events"
        assert sup.kv_event_endpoints() == {
            **{
                n: (f"tcp://127.0.0.1:{p.kv_events}", f"tcp://127.0.0.1:{p.kv_events_replay}")
                for n, p in ports.items()
                if n != "local"
            },
            "local": (f"ipc://{d}/local.events", f"ipc://{d}/local.replay"),
        }
        # Planning makes no directory: start() does.
        assert not d.exists()
    finally:
        sup.release_ports()


def test_socket_paths_too_long_for_af_unix_move_to_a_private_temp_directory(tmp_path: Path) -> None:
    log_dir = tmp_path / ("x" * 90)
    sup = Supervisor([sim("a"), sim("b")], LauncherConfig(log_dir=str(log_dir)), host_has_gpu=False)
    try:
        sup.plan()
        endpoints = sup.kv_event_endpoints()
        paths = [ep.removeprefix("ipc://") for pair in endpoints.values() for ep in pair]
        (d,) = {os.path.dirname(p) for p in paths}
        assert d.startswith(tempfile.gettempdir())
        assert all(len(os.fsencode(p)) <= 100 for p in paths)
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    finally:
        sup.release_ports()
    # A plan that is not started leaves no directory behind.
    assert not os.path.exists(d)


def is_socket(path: str) -> bool:
    return stat.S_ISSOCK(os.stat(path).st_mode)


def exists(path: str) -> bool:
    return os.path.lexists(path)


def listening_tcp_ports(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


async def test_a_started_loopback_simulator_publishes_on_private_ipc_sockets_only(tmp_path: Path) -> None:
    engines = [sim("a"), sim("b")]
    ctx = zmq.asyncio.Context()
    d = tmp_path / "kv-events"
    async with Supervisor(engines, LauncherConfig(log_dir=str(tmp_path), startup_timeout_s=60.0)) as sup:
        endpoints = sup.kv_event_endpoints()
        assert set(endpoints) == {"a", "b"}
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        paths = [ep.removeprefix("ipc://") for pair in endpoints.values() for ep in pair]
        assert all(ep.startswith(f"ipc://{d}/") for pair in endpoints.values() for ep in pair)
        assert len(set(paths)) == 4  # each engine its own stream and replay socket
        try:
            for _, replay in endpoints.values():
                # A replay request from the start: nothing published yet, only the end marker.
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(replay)
                await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                assert await dealer.poll(REPLY_TIMEOUT_S * 1000), f"no replay answer from {replay}"
                assert await dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
                dealer.close()
        finally:
            ctx.destroy(linger=0)
        # The engine process listens on TCP for HTTP only: no event port on any interface.
        (unit,) = sup.status()
        assert unit.pid is not None
        http = {urlsplit(u).port for u in sup.urls.values()}
        assert listening_tcp_ports(unit.pid) == http
        assert all(is_socket(p) for p in paths)
    # Stopped: the socket files and their directory are gone.
    assert not any(map(exists, paths))
    assert not d.exists()
