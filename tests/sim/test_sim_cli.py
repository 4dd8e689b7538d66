"""The command line: flags map to SimEngineConfig; several engines in one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest

from engine_launcher.sim.cli import build_parser, config_from_args, main

ROOT = Path(__file__).resolve().parents[2]


def test_flags_map_to_config() -> None:
    args = build_parser().parse_args(
        [
            "--port",
            "8001",
            "--port",
            "8002",
            "--role",
            "producer",
            "--block-size",
            "32",
            "--num-gpu-blocks-override",
            "100",
            "--speed",
            "50",
            "--no-arrival-check",
            "--global-cache-hit-threshold",
            "0.3",
            "--kv-lease-duration",
            "5",
            "--fault-error-rate",
            "0.1",
            "--fault-stall-after-tokens",
            "4",
            "--fault-stall-seconds",
            "2",
            "--fault-exit-after-tokens",
            "9",
            "--enable-admin",
            "--served-model-name",
            "m",
            "--step-overhead-s",
            "0.01",
            "--max-model-len",
            "1024",
        ]
    )
    cfg = config_from_args(args)
    assert args.port == [8001, 8002]
    assert (cfg.role, cfg.block_size, cfg.num_gpu_blocks, cfg.speed) == ("producer", 32, 100, 50.0)
    assert cfg.arrival_check is False
    assert cfg.global_cache_hit_threshold == 0.3
    assert cfg.kv_lease_duration == 5.0
    assert cfg.enable_admin
    assert cfg.model == "m"
    assert cfg.faults.error_rate == 0.1
    assert cfg.faults.exit_after_tokens == 9
    assert cfg.faults.stall_after_tokens == 4
    assert cfg.faults.stall_seconds == 2.0
    assert cfg.timing.step_overhead_s == 0.01
    assert cfg.max_model_len == 1024


def test_bad_values_exit_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--port", "0", "--global-cache-hit-threshold", "2"]) == 2
    assert "global_cache_hit_threshold" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--port", "0", "--role", "nope"])
    assert e.value.code == 2


def _start(*args: str) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_launcher.sim", *args, "--log-level", "warning"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ports: list[int] = []
    n = args.count("--port")
    assert proc.stdout is not None
    while len(ports) < n:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"simulator exited: {proc.stderr.read() if proc.stderr else ''}")
        ports.append(int(line.split("http://127.0.0.1:")[1].split()[0]))
    return proc, ports


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def _post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        answer: dict[str, Any] = orjson.loads(r.read())
        return answer


def test_two_engines_in_one_process_and_clean_stop() -> None:
    proc, ports = _start("--port", "0", "--port", "0", "--speed", "1000")
    try:
        assert len(set(ports)) == 2
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                assert r.status == 200
        body = _post(ports[0], "/v1/completions", {"prompt": "the world", "max_tokens": 3})
        assert body["usage"]["completion_tokens"] == 3
        # Separate engines: the second one saw no request.
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'vllm:generation_tokens_total{engine="0",model_name="sim-model"} 0.0' in text
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        _stop(proc)


def test_exit_fault_ends_the_process() -> None:
    proc, (port,) = _start("--port", "0", "--speed", "1000", "--fault-exit-after-tokens", "5")
    try:
        # The connection drops with the process: reset, refused or a URLError, by when it dies.
        with pytest.raises(OSError):  # noqa: PT011
            _post(port, "/v1/completions", {"prompt": "the world", "max_tokens": 50})
        assert proc.wait(timeout=10) == 3
    finally:
        _stop(proc)
