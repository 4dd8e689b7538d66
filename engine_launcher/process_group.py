"""Engine process groups: the child's setup between fork and exec, signalling a whole
group, and stopping one (SIGTERM, a grace period, then SIGKILL).

Each engine process leads its own session, so its group also holds vLLM's engine-core and
worker children; signalling the group reaches all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable

# How often a stopping group is checked for members left: processes that are not our
# children give no event when they exit, so their group is polled.
GROUP_POLL_S = 0.05
# How long SIGKILLed members may take to disappear.
KILL_GRACE_S = 5.0

try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    _PRCTL: Callable[..., int] | None = _LIBC.prctl if _LIBC is not None else None
except (OSError, AttributeError):
    _PRCTL = None
_PR_SET_PDEATHSIG = 1


def child_setup(parent_pid: int) -> Callable[[], None] | None:
    """preexec_fn: SIGTERM the child when the supervising thread dies (Linux only).

    Kept to one libc call on a preloaded function pointer: code between fork and exec must
    not take locks another thread might hold.
    """
    prctl = _PRCTL
    if prctl is None:
        return None

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return setup


def signal_group(pgid: int, sig: int) -> bool:
    """Send sig to a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies we cannot signal remain
        return False


def group_alive(pgid: int) -> bool:
    return signal_group(pgid, 0)


async def wait_group_gone(pgid: int, deadline: float) -> None:
    """Until no process of the group is left or the loop's clock passes deadline."""
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        if not group_alive(pgid):
            return
        await asyncio.sleep(GROUP_POLL_S)


async def terminate_group(proc: asyncio.subprocess.Process, stop_timeout_s: float) -> None:
    """SIGTERM the group `proc` leads, wait up to stop_timeout_s, then SIGKILL it."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    if not signal_group(pgid, signal.SIGTERM):
        await proc.wait()
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + stop_timeout_s
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(proc.wait(), stop_timeout_s)
    # vLLM's engine core and workers may outlive the API server by a moment.
    await wait_group_gone(pgid, deadline)
    signal_group(pgid, signal.SIGKILL)
    await proc.wait()
    await wait_group_gone(pgid, deadline + KILL_GRACE_S)


async def kill_group_leftovers(pgid: int) -> None:
    """SIGKILL what is left of a group whose leader exited, and wait until it is gone."""
    if signal_group(pgid, signal.SIGKILL):
        await wait_group_gone(pgid, asyncio.get_running_loop().time() + KILL_GRACE_S)


__all__ = ["child_setup", "group_alive", "kill_group_leftovers", "signal_group", "terminate_group", "wait_group_gone"]
