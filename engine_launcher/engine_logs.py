"""Engine log files: `{log_dir}/{name}.log`, appended to across restarts, each start
headed by a banner with its command line; the other engines of a shared sim process get
symlinks to it; a failed start quotes the file's last lines."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
from pathlib import Path
from typing import BinaryIO

from .commands import EngineCommand


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def prepare_logs(cmd: EngineCommand) -> None:
    """Create the log directory; every engine of a shared sim process finds its log under
    its own name."""
    log = Path(cmd.log_file)
    log.parent.mkdir(parents=True, exist_ok=True)
    for other in cmd.engines[1:]:
        link = log.parent / f"{other}.log"
        if link.is_symlink() or not link.exists():
            with contextlib.suppress(OSError):
                if link.is_symlink():
                    link.unlink()
                link.symlink_to(log.name)


def open_log(cmd: EngineCommand, attempt: int) -> BinaryIO:
    """The unit's log, opened for appending, with this start's banner written."""
    log = open(cmd.log_file, "ab")  # noqa: SIM115 - the caller hands it to the child and closes it
    log.write(
        f"\n==== engine-launcher: {_now()} start {cmd.name} (attempt {attempt})"
        f" serving {', '.join(cmd.engines)}\n$ {cmd.shell_line()}\n".encode()
    )
    log.flush()
    return log


def read_log_tail(path: str | Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


__all__ = ["open_log", "prepare_logs", "read_log_tail"]
