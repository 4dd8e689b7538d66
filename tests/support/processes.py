"""Processes started in their own process group and stopped by that group's id.

Never by name: other engineers run engines and routers on the same machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


def start_group(argv: list[str], **popen_kw: Any) -> subprocess.Popen[Any]:
    """Popen(argv) as the leader of a new session, so its group id is its pid and a stop
    reaches every process it starts."""
    return subprocess.Popen(argv, start_new_session=True, **popen_kw)


def signal_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to a process group; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _stat_fields(pid: str | int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pid_gone(pid: int) -> bool:
    """True when the process is dead: gone, or a zombie waiting for its reaper."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    fields = _stat_fields(pid)  # a zombie still answers kill(0)
    return fields is None or fields[0] == "Z"


def group_gone(pgid: int) -> bool:
    """True when the kernel knows no process in the group (zombies still count)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return True
    return False


def group_has_live_members(pgid: int) -> bool:
    """Whether a process that is not a zombie is still in the group."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def children_of(pid: int) -> list[int]:
    """Direct children of pid, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None and int(fields[1]) == pid:
                out.append(int(entry))
    return out


def stop_group(proc: subprocess.Popen[Any], grace: float = 5.0, kill_wait: float = 10.0) -> None:
    """SIGTERM the group `proc` leads and wait up to `grace` s for all of it to end, then
    SIGKILL what is left; reaps `proc`."""
    pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        if not group_has_live_members(pgid):
            break
        signal_group(pgid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and group_has_live_members(pgid):
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.1)
            else:  # the leader is gone; what it started may still be ending
                time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
