"""The launcher as a subprocess for the launcher tests (stopped by process group only, never by name)."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import threading
import time

from support.processes import children_of, signal_group, start_group


class LauncherProcess:
    """`python -m engine_launcher ...` as a subprocess whose output lines can be awaited.

    The launcher runs in its own process group; kill() SIGKILLs that group and the groups
    of the engines it started (each engine has its own), for cleanup after a failed test.
    """

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.proc = start_group(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self.engine_groups: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:  # closed once the launcher's output ends: no pipe is leaked
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
                raise AssertionError(
                    f"no line with {needle!r} within {timeout} s; output:\n" + "\n".join(self.lines)
                ) from None
            if line is None:
                self.proc.wait()
                raise AssertionError(
                    f"launcher exited ({self.proc.returncode}) before printing "
                    f"{needle!r}; output:\n" + "\n".join(self.lines)
                )
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
            signal_group(pgid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
