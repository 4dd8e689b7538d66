"""The cache-hit threshold semantics (RFC vllm#24256), as plain functions without vLLM.

One definition used by both sides of the plugin: the API server validates the per-request
value, the scheduler decides. docs/ARCHITECTURE.md ("Threshold semantics") is the contract;
the simulator implements the same one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FIELD = "cache_hit_threshold"
GLOBAL_KEY = "global_cache_hit_threshold"
ARRIVAL_KEY = "cache_hit_arrival_check"


class ThresholdError(ValueError):
    """A threshold that is not a number in [0, 1]; `param` names where it came from."""

    def __init__(self, message: str, param: str, value: Any) -> None:
        super().__init__(message)
        self.param = param
        self.value = value


def validate_threshold(value: Any, param: str = FIELD) -> float | None:
    """None for absent/null; else a float in [0, 1], or ThresholdError.

    Strings are refused even when numeric ("0.5"): the field is a JSON number in the RFC,
    and accepting both would make two spellings of one request.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ThresholdError(
            f"{param} must be a number between 0 and 1, got {type(value).__name__} {value!r}", param, value
        )
    number = float(value)
    if not math.isfinite(number) or not 0.0 <= number <= 1.0:
        raise ThresholdError(f"{param} must be between 0 and 1, got {number}", param, number)
    return number


def request_threshold(top_level: Any, xargs: Mapping[str, Any] | None) -> float | None:
    """The per-request threshold: top-level wins over vllm_xargs; both must be valid."""
    top = validate_threshold(top_level, FIELD)
    xarg = validate_threshold((xargs or {}).get(FIELD), f"vllm_xargs.{FIELD}")
    return top if top is not None else xarg


@dataclass(frozen=True)
class PluginConfig:
    """Engine-wide settings from `--additional-config` (a JSON object)."""

    global_threshold: float = 0.0
    arrival_check: bool = True

    @classmethod
    def from_additional_config(cls, additional: Any) -> PluginConfig:
        if not isinstance(additional, Mapping):
            return cls()
        try:
            glob = validate_threshold(additional.get(GLOBAL_KEY), GLOBAL_KEY)
        except ThresholdError as exc:
            raise ValueError(f"--additional-config: {exc}") from None
        arrival = additional.get(ARRIVAL_KEY, True)
        if not isinstance(arrival, bool):
            raise ValueError(f"--additional-config: {ARRIVAL_KEY} must be true or false, got {arrival!r}")
        return cls(global_threshold=glob or 0.0, arrival_check=arrival)


def effective_threshold(extra_args: Mapping[str, Any] | None, config: PluginConfig) -> float:
    """The threshold the engine applies: the request's own value, else the global default.

    The API server already turned a bad value into HTTP 400; a bad value that reaches the
    engine another way (offline LLM API, a client bypassing the OpenAI layer) is ignored
    rather than failing the engine.
    """
    raw = (extra_args or {}).get(FIELD)
    try:
        value = validate_threshold(raw)
    except ThresholdError:
        value = None
    return config.global_threshold if value is None else value


def is_prefill_leg(kv_transfer_params: Mapping[str, Any] | None) -> bool:
    """A NIXL prefill leg (`do_remote_decode`) is never rejected: the router chose this
    engine to compute the prompt, a cold cache is the point."""
    return kv_transfer_params is not None and bool(kv_transfer_params.get("do_remote_decode"))


def below_threshold(hit_tokens: int, total_tokens: int, threshold: float) -> bool:
    """hit rate = hit / total (prompt + already generated tokens); reject when below T."""
    if threshold <= 0.0 or total_tokens <= 0:
        return False
    return hit_tokens / total_tokens < threshold
