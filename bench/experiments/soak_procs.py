"""The soak's processes: simulated engines and the router, each in its own process group
(killed and restarted by group id), and the router's RSS and CPU time from /proc."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

REPO = Path(__file__).resolve().parents[2]
MODEL = "sim-model"
PY = sys.executable


# --- processes ---------------------------------------------------------------------------


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before {url} answered")
        with contextlib.suppress(Exception), urllib.request.urlopen(url, timeout=1.0) as r:
            if r.status == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


def stop_group(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the process group, then SIGKILL; by group id only, never by name."""
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


@dataclass
class Engine:
    name: str
    port: int
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        deadline = time.monotonic() + 30
        while True:  # a killed engine's port may linger a moment
            with open(self.log, "ab") as log:  # the engine keeps its own copy of the descriptor
                self.proc = subprocess.Popen(
                    [
                        PY,
                        "-m",
                        "engine_launcher.sim",
                        "--port",
                        str(self.port),
                        "--model",
                        MODEL,
                        "--log-level",
                        "warning",
                        *self.args,
                    ],
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            try:
                wait_http(self.url + "/health", 30, self.proc)
                return
            except RuntimeError:
                stop_group(self.proc)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def kill(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        stop_group(self.proc)


def router_toml(port: int, engines: list[Engine], args: argparse.Namespace) -> str:
    return tomli_w.dumps(router_config(port, engines, args))


def router_config(port: int, engines: list[Engine], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "server": {"port": port, "host": "127.0.0.1", "max_concurrent_requests": 1024, "max_queued_requests": 1024},
        "routing": {"max_retries": 3, "max_resumes": 4},
        "timeouts": {"connect_s": 2.0, "first_token_s": 30.0, "idle_s": float(args.idle_s), "total_s": 120.0},
        "health": {"scrape_interval_s": 0.5, "check_interval_s": 1.0, "failure_threshold": 3, "cooldown_s": 3.0},
        "backends": [{"name": e.name, "url": e.url, "role": "decode", "models": [MODEL]} for e in engines],
    }


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def start_router(out: Path, config: str) -> subprocess.Popen[bytes]:
    """The router as its own process group, configured with `config`, logging to out/router.log."""
    (out / "router.toml").write_text(config)
    with open(out / "router.log", "ab") as log:  # the router keeps its own copy of the descriptor
        return subprocess.Popen(
            [PY, "-m", "router.cli", "--config", str(out / "router.toml"), "--no-engines"],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
