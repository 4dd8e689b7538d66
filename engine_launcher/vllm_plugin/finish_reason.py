"""The `cache_threshold` finish reason, added to vLLM's own enums in place.

Why in place instead of subclassing: `FinishReason` (vllm/v1/engine/__init__.py) is the
declared type of `EngineCoreOutput.finish_reason`, which msgspec decodes in the API server;
msgspec builds (and caches) its enum lookup from the class object the first time it meets
it, and other modules hold references to that same class. So the new member must be added
to *that* class, in every vLLM process, before the first engine output is decoded — which
is why `register()` (run by vLLM's plugin loader early in every process) calls
`ensure_extended()`. The value 5 follows REPETITION = 4, the last upstream member in 0.32.

`RequestStatus` (vllm/v1/request.py) gets FINISHED_CACHE_THRESHOLD, a finished status
(greater than PREEMPTED) mapped to the new reason, so the scheduler finishes a rejected
request the same way it finishes any other (`finish_requests`, `get_finished_reason`).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, TypeVar, cast

if TYPE_CHECKING:
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

_E = TypeVar("_E", bound=enum.IntEnum)

CACHE_THRESHOLD = "cache_threshold"
FINISH_REASON_NAME = "CACHE_THRESHOLD"
FINISH_REASON_VALUE = 5
STATUS_NAME = "FINISHED_CACHE_THRESHOLD"


def _add_member(cls: type[_E], name: str, value: int) -> _E:
    """Add `name = value` to an existing IntEnum (idempotent)."""
    existing = cast("_E | None", cls._member_map_.get(name))
    if existing is not None:
        if int(existing) != value:
            raise RuntimeError(f"{cls.__name__}.{name} already exists with value {int(existing)}")
        return existing
    if value in cls._value2member_map_:
        other = cls._value2member_map_[value]
        raise RuntimeError(
            f"{cls.__name__} value {value} is taken by {other.name}: this vLLM is not the "
            f"version the cache-hit threshold plugin was written for"
        )
    member = int.__new__(cls, value)
    member._name_ = name
    member._value_ = value
    member._sort_order_ = len(cls._member_names_)  # type: ignore[attr-defined]  # Enum's private order, untyped
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    # EnumType.__setattr__ refuses to rebind members, not to add attributes.
    type.__setattr__(cls, name, member)
    return member


def ensure_extended() -> None:
    """Make FinishReason.CACHE_THRESHOLD and RequestStatus.FINISHED_CACHE_THRESHOLD exist."""
    import vllm.v1.engine as engine_mod
    import vllm.v1.request as request_mod

    strings = engine_mod.FINISH_REASON_STRINGS
    if len(strings) == FINISH_REASON_VALUE:
        # FinishReason.__str__ indexes this module-level tuple at call time.
        # vLLM declares the tuple's length; the extended one is one longer on purpose.
        engine_mod.FINISH_REASON_STRINGS = (*strings, CACHE_THRESHOLD)  # type: ignore[assignment]
    elif len(strings) <= FINISH_REASON_VALUE or strings[FINISH_REASON_VALUE] != CACHE_THRESHOLD:
        raise RuntimeError(f"unexpected vllm FINISH_REASON_STRINGS {strings!r}")
    reason = _add_member(engine_mod.FinishReason, FINISH_REASON_NAME, FINISH_REASON_VALUE)

    status_cls = request_mod.RequestStatus
    if STATUS_NAME not in status_cls._member_map_:
        next_value = max(int(m) for m in status_cls) + 1
        _add_member(status_cls, STATUS_NAME, next_value)
    status = status_cls[STATUS_NAME]
    assert status_cls.is_finished(status)
    request_mod._FINISHED_REASON_MAP[status] = reason


def finish_reason() -> FinishReason:
    import vllm.v1.engine as engine_mod

    return engine_mod.FinishReason[FINISH_REASON_NAME]


def finished_status() -> RequestStatus:
    import vllm.v1.request as request_mod

    return request_mod.RequestStatus[STATUS_NAME]
