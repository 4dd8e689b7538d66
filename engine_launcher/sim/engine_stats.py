"""Counters over one simulated engine's life, for white-box checks (`SimEngine.snapshot()`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    step_count: int = 0
    total_generated: int = 0
    busy_model_seconds: float = 0.0
    busy_wall_seconds: float = 0.0
    leases_expired: int = 0
    failed_pulls: int = 0
    arrival_rejections: int = 0
    admission_rejections: int = 0
    preemptions: int = 0


__all__ = ["EngineStats"]
