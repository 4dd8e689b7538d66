"""Backends that come and go while the router runs.

Every backend has one owner, the source that put it in the fleet: the configuration file
(`config`, re-read on SIGHUP), the engines the router started (`engines`, fixed), the
admin API (`admin`), or a `[[discovery]]` table (`discovery:<index>`). A source states the
backends it wants (`reconcile`); the fleet adds the new ones and removes the ones that
went away. Removal never drops a request: the backend is drained first (no new request or
leg goes there) and forgotten only once nothing is in flight on it.

Each name is in one of three states, and every change is a synchronous step between them
(no await in between, so a cancelled task never leaves a half-made change behind):

- absent: `add` registers it (then health-checks it: it takes requests once one passed);
- active (registered, owned, in rotation): `remove` drains it and starts its drain task,
  which makes it removing; a `reconcile` that wants another configuration does the same and
  records the wanted one as its successor;
- removing (draining, its drain task waits for its last request): the latest wanted
  configuration wins. The same configuration as the draining one (`add`, `reconcile`)
  puts it back in rotation: the drain task is cancelled and forgotten and any successor
  dropped, in one step. Another one replaces the successor; a `reconcile` that no longer
  wants the name, or a `remove`, drops it. Once idle, the drain task forgets the name and,
  in the same step, registers the successor if there is one.

An operator's drain (`drain`, the admin API) belongs to the name: it holds across a
replacement and a removal called off, and ends with an explicit removal. A `reconcile`
decides everything on the fleet as it is when it starts, in one step; only the new
backends' health checks are awaited after, so a change that comes meanwhile (an admin
delete) is never undone by an older reload.

The drain task holds no state of its own: `_removals` (name -> drain task) and
`_successor` (name -> configuration and source) are changed only by these steps, so a
successor never outlives its drain and a name is never left waiting for a task that died.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from router import errors
from router.config.checks import Problems, check_url
from router.config.kv_events import check_backend_kv_events
from router.config.schema import BackendConfig, ConfigError
from router.fleet.health import HealthMonitor
from router.fleet.registry import BackendRegistry, BackendState
from router.names import Role

log = logging.getLogger("cachehit_router.fleet")

CONFIG, ENGINES, ADMIN = "config", "engines", "admin"
# Names appear in metric labels and admin URLs: keep them to a safe alphabet.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@\[\]-]{0,127}$")
# The KV-event stream of an engine added by an operator (router/fleet/kv_events.py).
_KV_EVENTS_FIELDS = ("kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic")
# How often a removal looks whether the drained backend's last request ended.
_IDLE_POLL_S = 0.02


class Fleet:
    def __init__(
        self,
        registry: BackendRegistry,
        monitor: HealthMonitor,
        *,
        on_added: Callable[[BackendState], None],
        on_removed: Callable[[str], None],
        initial: Mapping[str, str],
    ):
        self.registry = registry
        self.monitor = monitor
        self._on_added = on_added
        self._on_removed = on_removed
        self.owner: dict[str, str] = dict(initial)  # backend name -> source
        self._removals: dict[str, asyncio.Task[None]] = {}  # name -> its drain (removing)
        self._successor: dict[str, tuple[BackendConfig, str]] = {}  # name -> (config, source) once drained
        self._tasks: set[asyncio.Task[None]] = set()
        self.drained: set[str] = set()  # names an operator took out of rotation

    # --- queries ---------------------------------------------------------------------------
    def removing(self, name: str) -> bool:
        return name in self._removals

    def successor(self, name: str) -> BackendConfig | None:
        """The configuration that replaces `name` once its drain ends, if any."""
        pending = self._successor.get(name)
        return None if pending is None else pending[0]

    def owned_by(self, source: str) -> dict[str, BackendConfig]:
        return {
            n: self.registry.states[n].config
            for n, o in self.owner.items()
            if o == source and n in self.registry.states and n not in self._removals
        }

    # --- changes ---------------------------------------------------------------------------
    async def add(
        self, config: BackendConfig, source: str, checked: tuple[dict[str, float], tuple[str, ...] | None] | None = None
    ) -> BackendState:
        """Register `config` and run its first health check (it takes requests once one
        passes), or take `checked`, the result of one that just passed (it is then in
        rotation at once). A name being removed with the same configuration is put back
        (and a replacement waiting for its drain dropped)."""
        name = config.name
        if self.removing(name) and self.registry.states[name].config == config:
            self._keep(name, source)
            log.info("backend %s: back before its removal finished; in rotation again", name)
            return self.registry.states[name]
        state = self._register(config, source, checked)
        if checked is None:
            await self.monitor.check_one(name, with_health=True)
        return state

    def _register(
        self, config: BackendConfig, source: str, checked: tuple[dict[str, float], tuple[str, ...] | None] | None
    ) -> BackendState:
        name = config.name
        state = self.registry.add(config)  # ValueError for a taken name
        self.owner[name] = source
        if name in self.drained:  # the replacement of a backend an operator drained
            self.registry.set_draining(name, True)
        self._on_added(state)
        log.info("backend %s (%s, role %s) added by %s", name, config.url, config.role, source)
        if checked is not None:
            self.registry.record_scrape(name, *checked)
        return state

    def remove(self, name: str, replacing: bool = False) -> asyncio.Task[None]:
        """Drain `name`, then forget it once its last request ended (the returned task). A
        replacement waiting for that drain is dropped: the name goes, and an operator's
        drain of it with it. `replacing`: a successor follows (an operator's drain stays)."""
        self._successor.pop(name, None)
        if not replacing:
            self.drained.discard(name)
        task = self._removals.get(name)
        if task is not None:
            return task
        state = self.registry.states.get(name)
        if state is None:
            raise KeyError(name)
        self.registry.set_draining(name, True)
        task = self._removals[name] = self._spawn(self._forget_when_idle(name, state), f"remove-{name}")
        return task

    def drain(self, name: str, draining: bool) -> None:
        """An operator takes `name` out of rotation (its requests finish) or puts it back
        (not while it is being removed). The drain holds while the name is in the fleet,
        across a replacement and a removal called off."""
        (self.drained.add if draining else self.drained.discard)(name)
        self.registry.set_draining(name, draining or self.removing(name))

    def _keep(self, name: str, source: str) -> None:
        """Stop `name`'s removal: its drain task is cancelled and forgotten here, at once,
        with the replacement that waited for it (the task itself holds no state)."""
        self._removals.pop(name).cancel()
        self._successor.pop(name, None)
        self.registry.set_draining(name, name in self.drained)
        self.owner[name] = source

    async def _forget_when_idle(self, name: str, state: BackendState) -> None:
        # No deadline: every request has its own (timeouts.total_s), and forgetting a
        # backend with requests on it would lose their accounting.
        # inflight is a plain counter that many paths change; polling it costs nothing.
        while state.inflight:  # noqa: ASYNC110
            await asyncio.sleep(_IDLE_POLL_S)
        # From here on nothing awaits until the name is gone: a cancellation (`_keep`) can
        # only come while the loop above waits.
        self.registry.remove(name)
        self.monitor.forget(name)
        self.owner.pop(name, None)
        del self._removals[name]
        self._on_removed(name)
        log.info("backend %s removed (drained, nothing in flight)", name)
        pending = self._successor.pop(name, None)
        if pending is None:
            self.drained.discard(name)
        else:
            await self.add(*pending)

    async def reconcile(self, source: str, wanted: Mapping[str, BackendConfig], *, check_first: bool = False) -> None:
        """Make `source`'s backends those of `wanted`. With `check_first`, a new backend
        joins only once a health check passed (else the next reconcile tries again).

        A name still draining from an older configuration gets the wanted one as its
        successor (added once the drain ends), or back in rotation if it is the same.

        Every decision is taken at once, on the fleet as it is when the call starts; only
        health checks are awaited after. Deciding a name after awaiting another's check
        let a later change be undone: a name the operator deleted meanwhile came back."""
        new = self._decide(source, wanted)
        if not check_first:
            for config in new:
                self._register(config, source, None)
            await asyncio.gather(*(self.monitor.check_one(c.name, with_health=True) for c in new))
            return
        for config in new:
            try:
                checked = await self.monitor.check(config, with_health=True, want_models=not config.models)
            except (TimeoutError, Exception) as e:
                log.info("%s: %s (%s) not added yet, its health check failed: %s", source, config.name, config.url, e)
                continue
            if config.name in self.registry.states:  # added meanwhile
                continue
            self._register(config, source, checked)

    def _decide(self, source: str, wanted: Mapping[str, BackendConfig]) -> list[BackendConfig]:
        """`reconcile`'s changes but the additions, which it returns."""
        new = []
        for name, config in self.owned_by(source).items():
            if wanted.get(name) != config:
                self.remove(name, replacing=name in wanted)  # gone, or changed: a changed one comes back below
        for name, (config, src) in list(self._successor.items()):
            if src == source and wanted.get(name) != config:
                del self._successor[name]  # no longer wanted as it was
                if name not in wanted:
                    self.drained.discard(name)
        for name, config in wanted.items():
            state = self.registry.states.get(name)
            taken_by = self.owner.get(name) if name not in self._removals else None
            pending = self._successor.get(name)
            if pending is not None and pending[1] != source:
                taken_by = pending[1]
            if state is not None and taken_by is not None and taken_by != source:
                log.warning("%s: backend name %r is taken (by %s); skipped", source, name, taken_by)
                continue
            if self.removing(name):
                assert state is not None
                if state.config == config:
                    self._keep(name, source)  # back before its drain ended
                    log.info("backend %s: back before its removal finished; in rotation again", name)
                else:  # changed: the new one once the old one is gone
                    self._successor[name] = (config, source)
                continue
            if state is None:
                new.append(config)
        return new

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._removals.clear()
        self._successor.clear()


def backend_from_admin(raw: Any) -> BackendConfig:
    """The body of POST /admin/backends, validated (400 naming the field otherwise)."""
    if not isinstance(raw, dict):
        raise errors.bad_request("Expected a JSON object with name, url, role and models.")
    unknown = sorted(set(raw) - {"name", "url", "role", "models", "api_key", *_KV_EVENTS_FIELDS})
    if unknown:
        raise errors.bad_request(
            f"Unknown field {unknown[0]!r}; expected name, url, role, models, api_key, {', '.join(_KV_EVENTS_FIELDS)}.",
            param=unknown[0],
        )
    name, url = raw.get("name"), raw.get("url")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise errors.bad_request(
            "'name' must be 1-128 characters: letters, digits and . _ : @ [ ] -, starting with a letter or digit.",
            param="name",
        )
    if not isinstance(url, str):
        raise errors.bad_request("'url' must be a string: the engine's http:// or https:// base URL.", param="url")
    try:
        check_url("url", url)
    except ConfigError as e:
        raise errors.bad_request(str(e), param="url") from None
    role = raw.get("role", Role.DECODE)
    if role not in tuple(Role):
        raise errors.bad_request(f"'role' must be one of {', '.join(Role)}.", param="role")
    models = raw.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise errors.bad_request("'models' must be a list of model names.", param="models")
    api_key = raw.get("api_key", "")
    if not isinstance(api_key, str):
        raise errors.bad_request("'api_key' must be a string.", param="api_key")
    kv = {f: raw.get(f, "") for f in _KV_EVENTS_FIELDS}
    for f, v in kv.items():
        if not isinstance(v, str):
            raise errors.bad_request(f"'{f}' must be a string.", param=f)
    config = BackendConfig(name=name, url=url.rstrip("/"), role=Role(role), models=tuple(models), api_key=api_key, **kv)
    problems = Problems()
    check_backend_kv_events(problems, "backend", config)
    if problems.found:
        field = problems.found[0].split(":", 1)[0].removeprefix("backend.")
        raise errors.bad_request(problems.found[0].removeprefix("backend."), param=field)
    return config
