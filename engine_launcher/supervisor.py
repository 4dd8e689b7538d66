"""Engine processes: start, wait for health, restart with backoff, logs, stop.

Used in-process by the router (`router --config` starts the `[[engines]]` before serving)
and by `engine-launcher --config`. All methods run on the caller's asyncio loop.

API:

    sup = Supervisor(config.engines, config.launcher, host_has_gpu=None)
    urls = await sup.start(progress=None)   # {engine name: base URL}, every engine healthy
    sup.kv_event_endpoints()                # {engine name: (stream, replay) ZMQ endpoints}
    sup.status()                            # [UnitStatus], one per process, for display
    await sup.wait()                        # until stop() or every process gave up
    await sup.stop()                        # SIGTERM each process group, then SIGKILL

    async with Supervisor(...) as sup:      # start() on entry, stop() on exit
        ...

- `host_has_gpu`: None detects (commands.detect_host); True/False forces the command
  flavour (e.g. to print GPU command lines on a CPU machine).
- Ports: engines with port 0 (vllm engines with nixl_side_channel_port 0, engines with
  kv_events and kv_events_port or kv_events_replay_port 0) get free ports picked at
  `plan()`/`start()`. Each picked port stays bound by the supervisor (a socket that
  never listens) until just before its engine is spawned, so two engines of this launcher
  never pick the same port and other programs cannot take it meanwhile. A restarted engine
  keeps its ports, so its URL never changes.
- KV events: engines on a loopback host publish on ipc:// sockets in a 0o700 directory
  (event_dir.py: `{log_dir}/kv-events`, or a mkdtemp one when the paths would be too long
  for AF_UNIX), made at start(); stop() removes the socket files and the emptied directory.
- Processes: one per `EngineCommand` (a group of identical sim engines is one process). Each
  starts in its own session/process group (so stop() and restarts reach vLLM's engine-core
  and worker children too), with stdout+stderr appended to `{log_dir}/{name}.log` (other
  engines of a sim group get `{name}.log` symlinks to it). Children get SIGTERM if the
  supervising thread dies (Linux PR_SET_PDEATHSIG), so a killed launcher leaves no engine
  behind; run the supervisor on the main thread's loop.
- start(): spawns everything, then waits until every engine answers `GET /health` with 200
  within `launcher.startup_timeout_s`. The first engine that exits or times out makes start()
  stop everything and raise `EngineStartError` with that engine's log tail.
- Restarts: a process that exits while the supervisor runs is restarted after
  `restart_backoff_s * 2**(n-1)` seconds (capped at `backoff_max_s`) for its n-th
  consecutive restart; after `launcher.max_restarts` consecutive failed restarts it is given
  up (state "failed"). A process that stayed healthy for `stable_after_s` has its count reset,
  so rare crashes over a long life do not add up to giving up.
- progress: `progress(ProgressEvent)` is called on every state change (starting, healthy,
  exited, restarting, failed, stopped), during start() and afterwards; exceptions in the
  callback are not caught.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from router.config.schema import EngineConfig, LauncherConfig

from .commands import EngineCommand, build_commands
from .engine_logs import open_log, prepare_logs, read_log_tail
from .engine_status import (
    EXITED,
    FAILED,
    HEALTHY,
    PENDING,
    RESTARTING,
    STARTING,
    STOPPED,
    EngineStartError,
    ProgressCallback,
    ProgressEvent,
    UnitStatus,
)
from .event_dir import EventDir
from .host import HostInfo, detect_host
from .ports import EnginePorts, PortReservation, ports_to_pick, resolve_ports
from .process_group import child_setup, kill_group_leftovers, terminate_group


@dataclass(eq=False)
class _Unit:
    cmd: EngineCommand
    role: str
    proc: asyncio.subprocess.Process | None = None
    state: str = PENDING
    restarts: int = 0  # total over the supervisor's life (display)
    consecutive: int = 0  # restarts since the process last stayed up stable_after_s
    healthy_at: float | None = None
    last_exit_code: int | None = None
    attempt: int = 0
    watcher: asyncio.Task[None] | None = None


class Supervisor:
    def __init__(
        self,
        engines: Sequence[EngineConfig],
        launcher: LauncherConfig | None = None,
        host_has_gpu: bool | None = None,
        *,
        host: HostInfo | None = None,
        python: str = sys.executable,
        stop_timeout_s: float = 15.0,
        health_poll_s: float = 0.25,
        backoff_max_s: float = 60.0,
        stable_after_s: float = 60.0,
    ) -> None:
        self.engines = tuple(engines)
        self.launcher = launcher or LauncherConfig()
        host = host or detect_host()
        if host_has_gpu is True and not host.has_gpu:
            # GPU flags forced on a machine without GPUs (e.g. to print GPU command lines):
            # assume one GPU per vllm engine, or as many as the configured gpu_ids name.
            vllm = [e for e in self.engines if e.kind == "vllm"]
            count = max([len(vllm), 1] + [g + 1 for e in vllm for g in e.gpu_ids])
            host = HostInfo(gpu_count=count, cpu_ids=host.cpu_ids)
        elif host_has_gpu is False:
            host = HostInfo(gpu_count=0, cpu_ids=host.cpu_ids)
        self.host = host
        self.python = python
        self.stop_timeout_s = stop_timeout_s
        self.health_poll_s = health_poll_s
        self.backoff_max_s = backoff_max_s
        self.stable_after_s = stable_after_s
        self._roles = {e.name: e.role for e in self.engines}
        self._reservation = PortReservation()
        self._event_dir = EventDir(self.launcher.log_dir)
        self._units: list[_Unit] = []
        self._progress: ProgressCallback | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False
        self._done = asyncio.Event()
        self._started = False

    # -- planning ----------------------------------------------------------------------

    def plan(self) -> list[EngineCommand]:
        """Pick (and hold) free ports and build every command. Idempotent.

        Raises router.config.schema.ConfigError when the engines cannot be laid out (port clash,
        not enough GPUs).
        """
        if not self._units:
            try:
                for name, which, host in ports_to_pick(self.engines):
                    self._reservation.pick(name, which, host)
                ports = resolve_ports(self.engines, self._reservation.picked)
                ipc_dir = self._event_dir.plan(self.engines)
                cmds = build_commands(
                    self.engines, ports, self.host, log_dir=self.launcher.log_dir, python=self.python, ipc_dir=ipc_dir
                )
            except BaseException:
                self._reservation.release_all()
                self._event_dir.discard()
                raise
            self._units = [_Unit(cmd=c, role=self._roles[c.engines[0]]) for c in cmds]
        return [u.cmd for u in self._units]

    def release_ports(self) -> None:
        """Stop holding the picked ports (after a plan() that will not be started)."""
        self._reservation.release_all()
        if not self._started:
            self._event_dir.discard()

    @property
    def ports(self) -> dict[str, EnginePorts]:
        return resolve_ports(self.engines, self._reservation.picked)

    @property
    def urls(self) -> dict[str, str]:
        """Engine name -> base URL (after plan()/start())."""
        return {n: u for unit in self._units for n, u in unit.cmd.urls.items()}

    def kv_event_endpoints(self) -> dict[str, tuple[str, str]]:
        """Engine name -> (stream, replay) endpoints the router connects to, for the engines
        publishing KV events (after plan()/start(); restarts keep them)."""
        return {n: ep for unit in self._units for n, ep in unit.cmd.kv_events.items()}

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self, progress: ProgressCallback | None = None) -> dict[str, str]:
        """Start every engine and wait until all are healthy; returns name -> URL."""
        if self._started:
            raise RuntimeError("Supervisor.start() called twice")
        self._started = True
        self._progress = progress
        self.plan()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        try:
            self._event_dir.create()
            for unit in self._units:
                prepare_logs(unit.cmd)
                await self._spawn(unit)
            waits = [asyncio.create_task(self._wait_healthy(u)) for u in self._units]
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        except BaseException:
            await self.stop()
            raise
        for unit in self._units:
            unit.watcher = asyncio.create_task(self._watch(unit), name=f"watch-{unit.cmd.name}")
        return self.urls

    async def stop(self) -> None:
        """Stop every engine: SIGTERM to each process group, wait, then SIGKILL. Idempotent."""
        self._stopping = True
        current = asyncio.current_task()
        watchers = [u.watcher for u in self._units if u.watcher and u.watcher is not current]
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await asyncio.gather(*(self._terminate(u) for u in self._units))
        for unit in self._units:
            if unit.state != STOPPED:
                self._set(unit, STOPPED)
        self._reservation.release_all()
        # A killed engine leaves its ipc socket files behind.
        self._event_dir.cleanup(self.kv_event_endpoints().values())
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._done.set()

    async def wait(self) -> None:
        """Return when stop() has run or every engine process has been given up."""
        await self._done.wait()

    async def __aenter__(self) -> Supervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def status(self) -> list[UnitStatus]:
        return [
            UnitStatus(
                name=u.cmd.name,
                kind=u.cmd.kind,
                role=u.role,
                engines=u.cmd.engines,
                urls=dict(u.cmd.urls),
                pid=u.proc.pid if u.proc and u.proc.returncode is None else None,
                state=u.state,
                restarts=u.restarts,
                last_exit_code=u.last_exit_code,
                log_file=u.cmd.log_file,
            )
            for u in self._units
        ]

    # -- internals ---------------------------------------------------------------------

    def _set(self, unit: _Unit, state: str, detail: str = "", event: str | None = None) -> None:
        unit.state = state
        if self._progress is not None:
            self._progress(ProgressEvent(unit.cmd.name, unit.cmd.engines, event or state, detail))

    async def _spawn(self, unit: _Unit) -> None:
        """Start the unit's process. Not interrupted by cancellation: a process created while
        stop() cancels this task must still land in unit.proc, or nobody would stop it."""
        task = asyncio.ensure_future(self._spawn_now(unit))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await task
            raise

    async def _spawn_now(self, unit: _Unit) -> None:
        unit.attempt += 1
        cmd = unit.cmd
        self._set(unit, STARTING, f"attempt {unit.attempt}")
        with open_log(cmd, unit.attempt) as log:
            # The engine binds these ports next; stop holding them. Sockets a killed
            # predecessor left are removed (ZeroMQ would replace them anyway).
            self._reservation.release(cmd.engines)
            self._event_dir.remove_sockets(cmd.kv_events.values())
            unit.proc = await asyncio.create_subprocess_exec(
                *cmd.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **cmd.env},
                cwd=cmd.cwd,
                start_new_session=True,
                preexec_fn=child_setup(os.getpid()),
            )
        unit.healthy_at = None
        if cmd.cpu_affinity:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(unit.proc.pid, cmd.cpu_affinity)

    async def _healthy_once(self, url: str) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(url) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _wait_healthy(self, unit: _Unit) -> None:
        """Until every engine of the unit answers /health 200; EngineStartError otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.launcher.startup_timeout_s
        proc = unit.proc
        assert proc is not None
        exited = asyncio.ensure_future(proc.wait())
        try:
            await self._poll_health(unit, proc, exited, deadline)
        finally:
            exited.cancel()

    async def _poll_health(
        self, unit: _Unit, proc: asyncio.subprocess.Process, exited: asyncio.Future[int], deadline: float
    ) -> None:
        loop = asyncio.get_running_loop()
        pending = dict(unit.cmd.health_urls())
        while pending:
            if proc.returncode is not None:
                raise self._start_error(unit, f"exited with code {proc.returncode} before it was healthy")
            if loop.time() > deadline:
                raise self._start_error(
                    unit, f"did not answer GET /health within {self.launcher.startup_timeout_s:g} s"
                )
            results = await asyncio.gather(*(self._healthy_once(u) for u in pending.values()))
            for name, ok in zip(list(pending), results, strict=True):
                if ok:
                    del pending[name]
            if pending:
                # Sleep one poll interval, waking early if the process dies meanwhile.
                await asyncio.wait({exited}, timeout=self.health_poll_s)
        unit.healthy_at = loop.time()
        self._set(unit, HEALTHY, f"pid {proc.pid}")

    def _start_error(self, unit: _Unit, reason: str) -> EngineStartError:
        return EngineStartError(unit.cmd.name, reason, unit.cmd.log_file, read_log_tail(unit.cmd.log_file))

    async def _terminate(self, unit: _Unit) -> None:
        """SIGTERM the unit's process group, wait up to stop_timeout_s, then SIGKILL it."""
        if unit.proc is not None:
            await terminate_group(unit.proc, self.stop_timeout_s)

    async def _watch(self, unit: _Unit) -> None:
        """Restart the unit's process whenever it exits, with exponential backoff."""
        loop = asyncio.get_running_loop()
        failure: str | None = None  # why the last restart did not become healthy
        while not self._stopping:
            assert unit.proc is not None
            code = await unit.proc.wait()
            if self._stopping:
                return
            unit.last_exit_code = code
            # A crashed API server can leave its engine core behind in the group, holding
            # memory and the NIXL port the restarted engine needs.
            await kill_group_leftovers(unit.proc.pid)
            if unit.healthy_at is not None and loop.time() - unit.healthy_at >= self.stable_after_s:
                unit.consecutive = 0
            self._set(unit, unit.state, failure or f"exit code {code}", event=EXITED)
            failure = None
            if unit.consecutive >= self.launcher.max_restarts:
                self._set(
                    unit,
                    FAILED,
                    f"gave up after {unit.consecutive} restart(s); exit code {code}; see {unit.cmd.log_file}",
                )
                if all(u.state == FAILED for u in self._units):
                    self._done.set()
                return
            unit.consecutive += 1
            unit.restarts += 1
            delay = min(self.launcher.restart_backoff_s * 2 ** (unit.consecutive - 1), self.backoff_max_s)
            self._set(
                unit,
                RESTARTING,
                f"exit code {code}; restart {unit.consecutive}/{self.launcher.max_restarts} in {delay:.1f} s",
            )
            await asyncio.sleep(delay)
            try:
                await self._spawn(unit)
                await self._wait_healthy(unit)
            except (EngineStartError, OSError) as e:
                # Counts as a failed restart: make sure it is gone, then loop (backoff grows).
                # (OSError: the process could not even be created; unit.proc is the old one.)
                failure = getattr(e, "reason", str(e))
                await self._terminate(unit)


__all__ = ["Supervisor"]
