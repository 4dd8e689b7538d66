"""SIGHUP: re-read router.toml (with the same environment and flag overrides) and apply
what can change while serving, without dropping a request.

Live: `[[backends]]` (new ones added, removed ones drained then forgotten, changed ones
replaced), `[[discovery]]`, `[routing]`, `server.api_keys`, `server.admin_api_key`,
`server.log_level` and `server.request_log`. Everything else is bound at start (the listening socket, limits, the
started engines, the upstream connection pool): a change there is named in a warning and
waits for a restart. A file that does not validate changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from router.config.schema import Config, ConfigError
from router.fleet.membership import CONFIG

if TYPE_CHECKING:
    from router.server.services import Reloadable

log = logging.getLogger("cachehit_router.reload")

LIVE = (
    "backends",
    "discovery",
    "routing",
    "server.api_keys",
    "server.admin_api_key",
    "server.log_level",
    "server.request_log",
)


def _table(section: Any) -> dict[str, Any]:
    """A section's keys as router.toml spells them (a policy's keys are `[routing]` keys)."""
    keys = {g.name: getattr(section, g.name) for g in dataclasses.fields(section)}
    keys.update(keys.pop("policy_keys", ()))
    return keys


def changed_keys(old: Config, new: Config) -> list[str]:
    """Dotted keys whose values differ: `section.key` for tables, the name for arrays."""
    out = []
    for f in dataclasses.fields(Config):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b:
            continue
        if dataclasses.is_dataclass(a):
            ta, tb = _table(a), _table(b)
            keys = [*ta, *(k for k in tb if k not in ta)]
            out += [f"{f.name}.{k}" for k in keys if ta.get(k) != tb.get(k)]
        else:
            out.append(f.name)
    return out


def split_changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """(keys applied now, keys that need a restart)."""
    changed = changed_keys(old, new)
    live = [k for k in changed if k in LIVE or k.split(".")[0] in LIVE]
    return live, [k for k in changed if k not in live]


def effective(old: Config, new: Config) -> Config:
    """The configuration the router runs with after a reload: `new`'s live keys (LIVE: a
    whole section, or one key of a table), `old`'s everything else."""
    out = old
    for key in LIVE:
        section, _, field = key.partition(".")
        if not field:
            out = dataclasses.replace(out, **{section: getattr(new, section)})
        else:
            table = dataclasses.replace(getattr(out, section), **{field: getattr(getattr(new, section), field)})
            out = dataclasses.replace(out, **{section: table})
    return out


async def reload(state: Reloadable, load: Callable[[], Config]) -> list[str]:
    """Re-read and apply; returns the keys that need a restart."""
    try:
        new = load()
    except ConfigError as e:
        log.error("reload refused, nothing changed: %s", e.report("router"))
        return []
    old = state.config
    live, fixed = split_changes(old, new)
    if fixed:
        log.warning(
            "reload: these keys cannot change while the router runs, restart it to apply them: %s", ", ".join(fixed)
        )
    if not live:
        log.info("reload: nothing to apply")
        return fixed
    cfg = effective(old, new)
    state.apply_config(cfg)  # routing, keys, log level: atomic for requests that start now
    if cfg.backends != old.backends:
        assert state.fleet is not None
        await state.fleet.reconcile(CONFIG, {b.name: b for b in cfg.backends})
    if cfg.discovery != old.discovery:
        assert state.discovery is not None
        await state.discovery.replace(cfg.discovery)
    log.info("reload applied: %s", ", ".join(live))
    return fixed
