"""What the launcher knows about the machine its engines run on: GPUs and usable CPUs.

`detect_host()` is the only function here that looks at the machine; the command builder
takes the `HostInfo` it returns (or one a test or `--host-type` makes up).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostInfo:
    """What the command builder needs to know about the machine the engines run on."""

    gpu_count: int = 0
    # CPUs this process may run on (os.sched_getaffinity), used to spread CPU engines.
    cpu_ids: tuple[int, ...] = (0,)
    # Physical indices of the GPUs engines may use (the launcher's own CUDA_VISIBLE_DEVICES
    # when it is restricted); empty: 0 .. gpu_count-1.
    gpu_ids: tuple[int, ...] = ()

    @property
    def usable_gpus(self) -> tuple[int, ...]:
        return self.gpu_ids or tuple(range(self.gpu_count))

    @property
    def has_gpu(self) -> bool:
        return self.gpu_count > 0


def detect_host() -> HostInfo:
    """Count NVIDIA GPUs (driver's /proc entries, else /dev/nvidiaN) and usable CPUs."""
    try:
        cpu_ids = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpu_ids = tuple(range(os.cpu_count() or 1))
    proc = Path("/proc/driver/nvidia/gpus")
    gpus = sum(1 for _ in proc.iterdir()) if proc.is_dir() else sum(1 for _ in Path("/dev").glob("nvidia[0-9]*"))
    gpus, gpu_ids = visible_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return HostInfo(gpu_count=gpus, cpu_ids=cpu_ids or (0,), gpu_ids=gpu_ids)


def visible_gpus(found: int, visible: str | None) -> tuple[int, tuple[int, ...]]:
    """(GPU count, physical indices) given the GPUs found and the launcher's own
    CUDA_VISIBLE_DEVICES. A restricted launcher keeps its engines inside that set. Engines
    get physical indices (their CUDA_VISIBLE_DEVICES replaces the launcher's), so only
    numeric entries can be honoured that way; UUID entries only limit the count."""
    if not found or visible is None:
        return found, ()
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if "-1" in entries:  # CUDA stops at the first invalid index
        entries = entries[: entries.index("-1")]
    count = min(found, len(entries))
    if entries and all(v.isdigit() for v in entries):
        return count, tuple(int(v) for v in entries[:count])
    return count, ()


__all__ = ["HostInfo", "detect_host", "visible_gpus"]
