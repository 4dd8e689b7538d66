"""Process checks shared by the launcher tests (by PID / process group only)."""
from __future__ import annotations

import os


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
    except ProcessLookupError:
        return True
    except PermissionError:
        return True
    return False
