"""Process helpers shared by the launcher tests (by PID / process group only, never by name)."""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path


def pid_gone(pid: int) -> bool:
    """True when the process is dead: gone, or a zombie waiting for its reaper."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    # A zombie still answers kill(0).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return True
    return False


def children_of(pid: int) -> list[int]:
    """Direct children of pid, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if int(fields[1]) == pid:
            out.append(int(d.name))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LauncherProcess:
    """`python -m engine_launcher ...` as a subprocess whose output lines can be awaited.

    The launcher runs in its own process group; kill() SIGKILLs that group and the groups
    of the engines it started (each engine has its own), for cleanup after a failed test.
    """

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=cwd, start_new_session=True)
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self.engine_groups: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for_line(self, needle: str, timeout: float) -> str:
        """Return the first output line containing needle; AssertionError with all output
        if the launcher exits or the hang guard expires first."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self._q.get(timeout=max(0.01, remaining))
            except queue.Empty:
                raise AssertionError(f"no line with {needle!r} within {timeout} s; output:\n"
                                     + "\n".join(self.lines)) from None
            if line is None:
                self.proc.wait()
                raise AssertionError(f"launcher exited ({self.proc.returncode}) before printing "
                                     f"{needle!r}; output:\n" + "\n".join(self.lines))
            self.lines.append(line)
            if needle in line:
                return line

    def output(self, timeout: float) -> str:
        """Wait for the launcher to exit and return its whole output."""
        self.proc.wait(timeout=timeout)
        while True:
            try:
                line = self._q.get(timeout=timeout)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return "\n".join(self.lines)

    def record_engine_groups(self) -> list[int]:
        """The launcher's children are the engine process-group leaders."""
        kids = children_of(self.proc.pid)
        self.engine_groups.update(kids)
        return kids

    def kill(self) -> None:
        for pgid in [self.proc.pid, *self.engine_groups]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
