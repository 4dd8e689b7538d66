"""Engine processes: start, wait for health, restart with backoff, logs, stop.

Used in-process by the router (`router --config` starts the `[[engines]]` before serving)
and by `engine-launcher --config`. All methods run on the caller's asyncio loop.

API:

    sup = Supervisor(config.engines, config.launcher, host_has_gpu=None)
    urls = await sup.start(progress=None)   # {engine name: base URL}, every engine healthy
    sup.status()                            # [UnitStatus], one per process, for display
    await sup.wait()                        # until stop() or every process gave up
    await sup.stop()                        # SIGTERM each process group, then SIGKILL

    async with Supervisor(...) as sup:      # start() on entry, stop() on exit
        ...

- `host_has_gpu`: None detects (commands.detect_host); True/False forces the command
  flavour (e.g. to print GPU command lines on a CPU machine).
- Ports: engines with port 0 (and vllm engines with nixl_side_channel_port 0) get free ports
  picked at `plan()`/`start()`. Each picked port stays bound by the supervisor (a socket that
  never listens) until just before its engine is spawned, so two engines of this launcher
  never pick the same port and other programs cannot take it meanwhile. A restarted engine
  keeps its ports, so its URL never changes.
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
import ctypes
import datetime as _dt
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from router.config.schema import EngineConfig, LauncherConfig

from .commands import (
    EngineCommand,
    EnginePorts,
    HostInfo,
    build_commands,
    detect_host,
    ports_to_pick,
    resolve_ports,
)

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
    watcher: asyncio.Task | None = None


# --- port reservation ----------------------------------------------------------------


class PortReservation:
    """Free ports picked by binding port 0 and kept bound until released.

    Holding every picked socket until its engine is spawned makes the picks distinct and
    keeps other programs off them in the meantime; the socket never listens, so releasing
    it leaves no TIME_WAIT behind and the engine binds the port at once.
    """

    def __init__(self) -> None:
        self._socks: dict[tuple[str, str], socket.socket] = {}
        self.picked: dict[tuple[str, str], int] = {}

    def pick(self, engine: str, which: str, host: str) -> int:
        bind_host = "127.0.0.1" if host == "localhost" else host
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.bind((bind_host, 0))
        except OSError:
            # Not an address of this machine (e.g. a NIXL side-channel host advertised through
            # NAT): any interface's free port will do.
            s.close()
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        port = s.getsockname()[1]
        self._socks[(engine, which)] = s
        self.picked[(engine, which)] = port
        return port

    def release(self, engines: Sequence[str]) -> None:
        for key in [k for k in self._socks if k[0] in engines]:
            self._socks.pop(key).close()

    def release_all(self) -> None:
        for s in self._socks.values():
            s.close()
        self._socks.clear()


# --- process helpers -----------------------------------------------------------------

try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    _PRCTL = _LIBC.prctl if _LIBC is not None else None
except (OSError, AttributeError):
    _PRCTL = None
_PR_SET_PDEATHSIG = 1


def _child_setup(parent_pid: int) -> Callable[[], None] | None:
    """preexec_fn: SIGTERM the child when the supervising thread dies (Linux only).

    Kept to one libc call on a preloaded function pointer: code between fork and exec must
    not take locks another thread might hold.
    """
    if _PRCTL is None:
        return None

    def setup() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return setup


def _signal_group(pgid: int, sig: int) -> bool:
    """Send sig to a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies we cannot signal remain
        return False


def _group_alive(pgid: int) -> bool:
    return _signal_group(pgid, 0)


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


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- the supervisor ------------------------------------------------------------------


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
                cmds = build_commands(self.engines, ports, self.host, log_dir=self.launcher.log_dir, python=self.python)
            except BaseException:
                self._reservation.release_all()
                raise
            self._units = [_Unit(cmd=c, role=self._roles[c.engines[0]]) for c in cmds]
        return [u.cmd for u in self._units]

    def release_ports(self) -> None:
        """Stop holding the picked ports (after a plan() that will not be started)."""
        self._reservation.release_all()

    @property
    def ports(self) -> dict[str, EnginePorts]:
        return resolve_ports(self.engines, self._reservation.picked)

    @property
    def urls(self) -> dict[str, str]:
        """Engine name -> base URL (after plan()/start())."""
        return {n: u for unit in self._units for n, u in unit.cmd.urls.items()}

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
            for unit in self._units:
                self._prepare_logs(unit)
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

    async def __aexit__(self, *exc) -> None:
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

    def _prepare_logs(self, unit: _Unit) -> None:
        log = Path(unit.cmd.log_file)
        log.parent.mkdir(parents=True, exist_ok=True)
        # Every engine of a shared sim process finds its log under its own name.
        for other in unit.cmd.engines[1:]:
            link = log.parent / f"{other}.log"
            if link.is_symlink() or not link.exists():
                with contextlib.suppress(OSError):
                    if link.is_symlink():
                        link.unlink()
                    link.symlink_to(log.name)

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
        with open(cmd.log_file, "ab") as log:
            log.write(
                f"\n==== engine-launcher: {_now()} start {cmd.name} (attempt {unit.attempt})"
                f" serving {', '.join(cmd.engines)}\n$ {cmd.shell_line()}\n".encode()
            )
            log.flush()
            # The engine binds these ports next; stop holding them.
            self._reservation.release(cmd.engines)
            unit.proc = await asyncio.create_subprocess_exec(
                *cmd.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **cmd.env},
                cwd=cmd.cwd,
                start_new_session=True,
                preexec_fn=_child_setup(os.getpid()),
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
        self, unit: _Unit, proc: asyncio.subprocess.Process, exited: asyncio.Future, deadline: float
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
            for name, ok in zip(list(pending), results):
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
        proc = unit.proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the leader's pid is the group id
        if not _signal_group(pgid, signal.SIGTERM):
            await proc.wait()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stop_timeout_s
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), self.stop_timeout_s)
        # vLLM's engine core and workers may outlive the API server by a moment.
        while _group_alive(pgid) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        _signal_group(pgid, signal.SIGKILL)
        await proc.wait()
        while _group_alive(pgid) and loop.time() < deadline + 5.0:
            await asyncio.sleep(0.05)

    async def _kill_leftovers(self, pgid: int) -> None:
        if _signal_group(pgid, signal.SIGKILL):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5.0
            while _group_alive(pgid) and loop.time() < deadline:
                await asyncio.sleep(0.05)

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
            await self._kill_leftovers(unit.proc.pid)
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


__all__ = [
    "EXITED",
    "FAILED",
    "HEALTHY",
    "PENDING",
    "RESTARTING",
    "STARTING",
    "STOPPED",
    "EngineStartError",
    "PortReservation",
    "ProgressCallback",
    "ProgressEvent",
    "Supervisor",
    "UnitStatus",
    "read_log_tail",
]
