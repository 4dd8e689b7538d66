"""The checks configuration parsing is made of: type checks, value ranges, URLs and ports,
and the collector that reports every problem of a file at once.

Every message names the key (dotted path, with list indexes) and what was expected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from router.config.schema import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class Problems:
    """Every problem of one file, so that a single run reports them all instead of one
    per attempt. Checks are independent where they can be; only a table that is not a
    table, or lacks a required key, skips the checks of its values."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def add(self, message: str) -> None:
        self.found.append(message)

    def check(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), or None with its problems recorded."""
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            self.found.extend(e.problems)
            return None

    def raise_if_any(self) -> None:
        if self.found:
            raise ConfigError(*self.found)


def _type_name(t: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(t, str(t))


def check_type(key: str, value: Any, typ: type) -> Any:
    """`value` if it is of `typ` (an integer counts as a number), else a ConfigError."""
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {_type_name(typ)}, got {value!r}")
    return value


def str_list(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
    return tuple(value)


def int_list(key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{key}: expected a list of integers, got {value!r}")
    return tuple(value)


def string_table(key: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ConfigError(f"{key}: expected a table of strings, got {value!r}")
    return tuple(sorted(value.items()))


def _enum_member(key: str, value: Any, names: type[StrEnum]) -> Any:
    """A string, as the member of `names` it spells; a string that spells none is kept as
    it is, for the table's own check to name the choices."""
    value = check_type(key, value, str)
    return names(value) if value in names._value2member_map_ else value


def build_table(
    problems: Problems, cls: type[T], key: str, raw: Any, special: dict[str, Any] | None = None
) -> T | None:
    """Dataclass `cls` from table `raw`. Unknown keys and wrong types are recorded in
    `problems` and the default is kept for them, so that the checks of the table's other
    values still run; None when `raw` is not a table or a required key is missing."""
    if not isinstance(raw, dict):
        problems.add(f"{key}: expected a table, got {raw!r}")
        return None
    special = special or {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        sub = f"{key}.{k}" if key else k
        if k not in fields:
            problems.add(f"{sub}: unknown key (expected one of: {', '.join(sorted(fields))})")
            continue
        default = fields[k].default
        parse: Callable[..., Any]
        args: tuple[Any, ...]
        if k in special:
            parse, args = special[k], (sub, v)
        elif isinstance(default, tuple):
            parse, args = str_list, (sub, v)
        elif isinstance(default, StrEnum):
            parse, args = _enum_member, (sub, v, type(default))
        else:
            parse, args = check_type, (sub, v, type(default) if default is not dataclasses.MISSING else str)
        found = len(problems.found)
        value = problems.check(parse, *args)
        if len(problems.found) == found:
            kwargs[k] = value
    required = [
        n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for n in required:
        if n not in raw:
            problems.add(f"{key}.{n}: required key is missing")
    if any(n not in kwargs for n in required):  # missing, or of the wrong type
        return None
    return cls(**kwargs)


def check_one_of(key: str, value: str, names: type[StrEnum]) -> None:
    if value not in names._value2member_map_:
        raise ConfigError(f"{key}: expected one of {', '.join(names)}, got {value!r}")


def check_positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: expected a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")


def check_stretch(key: str, value: float) -> None:
    """0 (off) or a factor of at least 1."""
    if value != 0 and not value >= 1.0:
        raise ConfigError(f"{key}: expected 0 (no bound) or a number >= 1, got {value!r}")


def check_fraction(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{key}: expected a number in [0, 1], got {value!r}")


def check_port(key: str, value: int, allow_zero: bool) -> None:
    if not (0 if allow_zero else 1) <= value <= 65535:
        raise ConfigError(f"{key}: expected a TCP port in [{0 if allow_zero else 1}, 65535], got {value!r}")


def check_url(key: str, value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key}: expected an http:// or https:// URL with a host, got {value!r}")
    try:
        _ = parts.port  # reading it checks the port
    except ValueError:
        raise ConfigError(f"{key}: expected a valid port in URL, got {value!r}") from None
    if parts.query or parts.fragment:
        raise ConfigError(f"{key}: expected a base URL without query or fragment, got {value!r}")
