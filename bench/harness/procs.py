"""Processes the benchmarks start: simulated engines, the router, vllm-router, helpers.

Every process starts in its own process group and is stopped by that group's id (SIGTERM,
then SIGKILL after a grace period); `ProcessSet` owns a run's processes and stops them
all on exit, also when the run fails. Nothing is ever killed by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

PY = sys.executable


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback (bound together, then released)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def free_port_run(n: int, low: int = 20000, high: int = 32000) -> int:
    """The first of `n` consecutive free TCP ports (a simulator process offsets each of its
    engines' KV-event ports by the engine's index, as vLLM offsets data-parallel ranks)."""
    for base in random.Random().sample(range(low, high - n), 200):
        socks: list[socket.socket] = []
        try:
            for pt in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", pt))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {n} consecutive free ports in [{low}, {high})")


def cpu_list() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def split_cores(no_pin: bool) -> tuple[list[int] | None, list[int] | None]:
    """(the proxy's core, everything else's cores): the last core for the process under
    measurement and the rest for load and backends; (None, None) when pinning is off or
    there is one core."""
    cores = cpu_list()
    if no_pin or len(cores) < 2:
        return None, None
    return [cores[-1]], cores[:-1]


def pinned(cmd: Sequence[str], cores: Sequence[int] | None) -> list[str]:
    """Prefix `cmd` with taskset when cores are given and taskset exists."""
    if cores and shutil.which("taskset"):
        return ["taskset", "-c", ",".join(map(str, cores)), *cmd]
    return list(cmd)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


# The checkout this bench runs from: its router and simulator are what the children run,
# not whatever an editable install of another checkout puts on their path.
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


def child_env(env: dict[str, Any] | None, root: str = SOURCE_ROOT) -> dict[str, str]:
    """The environment of a child: ours with `env`, `root` (the checkout whose code it runs)
    first on its module path."""
    base = {**os.environ, **(env or {})}
    path = [root, *[p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (root, SOURCE_ROOT)]]
    return {**base, "PYTHONPATH": os.pathsep.join(path)}


@dataclass
class ProcessSet:
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, cmd: Sequence[str], env: dict[str, Any] | None = None, root: str = SOURCE_ROOT) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as f:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(
                list(cmd),
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=child_env(env, root),
            )
        p = Proc(name, popen, log_path)
        self.procs.append(p)
        return p

    def stop(self, p: Proc, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; never raises."""
        try:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.popen.wait(grace_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGKILL)
                    try:
                        p.popen.wait(30)
                    except subprocess.TimeoutExpired:
                        print(f"warning: {p.name} (pid {p.pid}) still running after SIGKILL", file=sys.stderr)
            else:
                # The leader exited; children of its group may remain.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        finally:
            if p in self.procs:
                self.procs.remove(p)

    def stop_all(self) -> None:
        for p in reversed(list(self.procs)):
            self.stop(p)

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


class ExitedBeforeReady(RuntimeError):
    """A process of a benchmark's cluster exited before it answered: nothing was measured
    yet, so the run can be started again (e.g. a port picked free was taken before it bound)."""


async def wait_http(url: str, proc: Proc | None = None, timeout_s: float = 60.0, expect: int = 200) -> None:
    """Until GET url answers `expect`; raises with the process's log tail on failure."""
    deadline = time.monotonic() + timeout_s
    last = ""
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise ExitedBeforeReady(
                    f"{proc.name} exited ({proc.popen.returncode}) before {url} answered:\n{proc.log_tail()}"
                )
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    await r.read()
                    if r.status == expect:
                        return
                    last = f"HTTP {r.status}"
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                last = repr(e)
            await asyncio.sleep(0.1)
    tail = proc.log_tail() if proc is not None else ""
    raise RuntimeError(f"{url} did not answer {expect} within {timeout_s:g} s ({last})\n{tail}")


class RSSSampler:
    """Samples a process's CPU time and resident memory (psutil) in the background."""

    def __init__(self, pid: int, interval_s: float = 0.25):
        import psutil

        self.proc = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_rss = 0
        self._task: asyncio.Task[None] | None = None
        self.cpu0 = self.cpu_s()

    def cpu_s(self) -> float:
        try:
            t = self.proc.cpu_times()
            total = t.user + t.system
            for c in self.proc.children(recursive=True):
                with contextlib.suppress(Exception):
                    ct = c.cpu_times()
                    total += ct.user + ct.system
            return float(total)
        except Exception:
            return 0.0

    def rss(self) -> int:
        try:
            return int(self.proc.memory_info().rss)
        except Exception:
            return 0

    def start(self) -> None:
        self.cpu0 = self.cpu_s()
        self.peak_rss = self.rss()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.peak_rss = max(self.peak_rss, self.rss())
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> tuple[float, int]:
        """(CPU seconds since start, peak RSS bytes)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.peak_rss = max(self.peak_rss, self.rss())
        return self.cpu_s() - self.cpu0, self.peak_rss
