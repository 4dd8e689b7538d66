"""What the supervisor reports about its engine processes: their states, the progress
events it calls back with, status snapshots for display, and the error a failed start
raises."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Unit (process) states.
PENDING, STARTING, HEALTHY, RESTARTING, FAILED, STOPPED = (
    "pending",
    "starting",
    "healthy",
    "restarting",
    "failed",
    "stopped",
)
EXITED = "exited"  # an event only: the process ended; the state becomes restarting/failed


class EngineStartError(RuntimeError):
    """An engine did not become healthy; the message carries the reason and its log tail."""

    def __init__(self, name: str, reason: str, log_file: str, log_tail: str):
        self.name, self.reason, self.log_file, self.log_tail = name, reason, log_file, log_tail
        tail = log_tail.rstrip() or "(log is empty)"
        super().__init__(f"engine {name!r} {reason}; last lines of {log_file}:\n{tail}")


@dataclass(frozen=True)
class ProgressEvent:
    """A state change of one process (`unit`, named after its first engine)."""

    unit: str
    engines: tuple[str, ...]
    state: str
    detail: str = ""

    @property
    def name(self) -> str:
        return self.unit


ProgressCallback = Callable[[ProgressEvent], None]


@dataclass(frozen=True)
class UnitStatus:
    """A snapshot of one engine process, for display."""

    name: str
    kind: str
    role: str
    engines: tuple[str, ...]
    urls: dict[str, str]
    pid: int | None
    state: str
    restarts: int
    last_exit_code: int | None
    log_file: str


__all__ = [
    "EXITED",
    "FAILED",
    "HEALTHY",
    "PENDING",
    "RESTARTING",
    "STARTING",
    "STOPPED",
    "EngineStartError",
    "ProgressCallback",
    "ProgressEvent",
    "UnitStatus",
]
