"""The simulator's KV event configuration: defaults, errors naming the key, and the
command line giving each engine of a process its own ports or socket files."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from engine_launcher.sim.cli import build_parser, config_from_args, kv_events_configs
from engine_launcher.sim.kv_events import KVEventsConfig, offset_endpoint_port, parse_kv_events_config
from support.sim_kv_events import END_SEQ, sync_replay


def test_config_defaults_and_errors_name_the_key() -> None:
    cfg = KVEventsConfig()
    assert (cfg.enable_kv_cache_events, cfg.publisher, cfg.endpoint, cfg.replay_endpoint) == (
        False,
        "null",
        "tcp://*:5557",
        None,
    )
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == (10_000, 100_000, 100_000, "")
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").active
    for text, key in (
        ('{"publisher": "kafka"}', "publisher"),
        ('{"bogus": 1}', "bogus"),
        ('{"buffer_steps": "many"}', "buffer_steps"),
        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
        ('{"endpoint": "http://x:1"}', "endpoint"),
    ):
        with pytest.raises(ValueError, match=rf"kv_events_config\.{key}:"):
            parse_kv_events_config(text)
    with pytest.raises(ValueError, match="JSON object"):
        parse_kv_events_config("[1]")
    args = build_parser().parse_args(
        ["--port", "0", "--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv@a"}']
    )
    parsed = config_from_args(args).kv_events_config
    assert parsed is not None
    cfg = parsed
    assert cfg.active
    assert cfg.topic == "kv@a"
    assert config_from_args(build_parser().parse_args(["--port", "0"])).kv_events_config is None
    # Several engines in one process: ports offset by the engine's index, as DP ranks.
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"


def test_one_events_config_per_port_is_taken_as_given() -> None:
    def configs(*argv: str) -> list[KVEventsConfig | None]:
        return kv_events_configs(build_parser().parse_args(["--port", "0", "--port", "0", *argv]))

    a = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:7001", "replay_endpoint": "tcp://*:7002"}'
    b = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:7101", "replay_endpoint": "tcp://*:7102"}'
    got = configs("--kv-events-config", a, "--kv-events-config", b)
    assert [c and (c.endpoint, c.replay_endpoint) for c in got] == [
        ("tcp://*:7001", "tcp://*:7002"),
        ("tcp://*:7101", "tcp://*:7102"),
    ]
    # Once: offset per engine, as before.
    once = configs("--kv-events-config", a)
    assert [c and c.endpoint for c in once] == ["tcp://*:7001", "tcp://*:7002"]
    assert configs() == [None, None]
    three = build_parser().parse_args(["--port", "0", "--kv-events-config", a, "--kv-events-config", b])
    with pytest.raises(ValueError, match=r"--kv-events-config: given 2 times for 1 --port"):
        kv_events_configs(three)


def free_port_pair(avoid: tuple[int, ...] = ()) -> int:
    """A port p with p + 1 free too (the second engine's), both outside `avoid`."""
    from support.ports import free_port

    while True:
        port = free_port()
        if port + 1 > 65535 or {port, port + 1} & set(avoid):
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
        return port


def test_the_command_line_offsets_each_engines_ports() -> None:
    pub = free_port_pair()
    replay = free_port_pair((pub, pub + 1, pub - 1))
    config = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{pub}", "replay_endpoint": "tcp://*:{replay}"}}'
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_launcher.sim", "--port", "0", "--port", "0", "--kv-events-config", config],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    ctx = zmq.Context()
    try:
        assert proc.stdout is not None
        for _ in range(2):
            assert "sim engine listening" in proc.stdout.readline()
        # Both engines answer replay (with the end marker alone: nothing published yet), the
        # second one port + 1, as vLLM's DP rank 1.
        for rank in (0, 1):
            assert sync_replay(ctx, f"tcp://127.0.0.1:{replay + rank}", 0) == [[b"", b"", END_SEQ, b""]]
    finally:
        ctx.destroy(linger=0)
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_one_ipc_config_gives_each_engine_of_a_process_its_own_socket_files(tmp_path: Path) -> None:
    """The launcher's loopback engines publish on ipc sockets; given once for several
    engines, each engine binds the paths suffixed with its index (vLLM refuses ipc for
    ranks above 0, where the simulator still must not share a socket file)."""
    assert offset_endpoint_port("ipc:///run/kv.events", 1) == "ipc:///run/kv.events_dp1"
    assert offset_endpoint_port("ipc:///run/kv.events", 0) == "ipc:///run/kv.events"
    pub, replay = tmp_path / "kv.events", tmp_path / "kv.replay"
    config = f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{pub}", "replay_endpoint": "ipc://{replay}"}}'
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_launcher.sim", "--port", "0", "--port", "0", "--kv-events-config", config],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    stdout = proc.stdout
    assert stdout is not None  # a pipe
    ctx = zmq.Context()
    sockets = [pub, replay, tmp_path / "kv.events_dp1", tmp_path / "kv.replay_dp1"]
    try:
        for _ in range(2):
            assert "sim engine listening" in stdout.readline()
        # Bound (ipc is a bind endpoint, as in vLLM): the four socket files exist.
        assert all(p.is_socket() for p in sockets)
        for path in (replay, tmp_path / "kv.replay_dp1"):
            assert sync_replay(ctx, f"ipc://{path}", 0) == [[b"", b"", END_SEQ, b""]]
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(timeout=30)
        stdout.close()
    # A clean stop closes the sockets, and ZeroMQ removes their files.
    assert not any(p.exists() for p in sockets)
