"""Supervisor: real processes, real ports, real signals.

The lifecycle test runs the real simulator; failure paths the simulator cannot show on
demand use the `fake_python` stand-in interpreter (see conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine_launcher.engine_status import FAILED, HEALTHY, EngineStartError, ProgressEvent, UnitStatus
from engine_launcher.supervisor import Supervisor
from router.config.schema import EngineConfig, LauncherConfig
from router.names import EngineRole
from support.polling import eventually
from support.processes import group_gone, pid_gone

# Hang guard for awaited events (not a timing assertion: a healthy run takes a fraction).
EVENT_TIMEOUT_S = 60


class Events:
    """Collects progress events; lets a test await the next event matching a predicate."""

    def __init__(self) -> None:
        self.seen: list[ProgressEvent] = []
        self._changed = asyncio.Event()

    def __call__(self, ev: ProgressEvent) -> None:
        self.seen.append(ev)
        self._changed.set()

    async def next(self, unit: str, state: str, after: int = 0) -> ProgressEvent:
        async def find() -> ProgressEvent:
            while True:
                for ev in self.seen[after:]:
                    if ev.unit == unit and ev.state == state:
                        return ev
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(find(), EVENT_TIMEOUT_S)


async def get_status(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        return r.status


def running_pid(unit: UnitStatus) -> int:
    assert unit.pid is not None, f"{unit.name} has no process"
    return unit.pid


def launcher(tmp_path: Path, **kw: Any) -> LauncherConfig:
    base: dict[str, Any] = dict(
        log_dir=str(tmp_path / "logs"), startup_timeout_s=60.0, max_restarts=3, restart_backoff_s=0.05
    )
    base.update(kw)
    return LauncherConfig(**base)


def group_pids(sup: Supervisor) -> list[int]:
    return [s.pid for s in sup.status() if s.pid is not None]


async def wait_gone(pids: list[int]) -> None:
    await eventually(
        lambda: all(pid_gone(p) and group_gone(p) for p in pids),
        EVENT_TIMEOUT_S,
        f"engine processes {pids} and their groups gone",
        interval=0.05,
    )


async def test_sim_engines_start_restart_after_sigkill_and_stop(tmp_path: Path, kill_leftovers: list[int]) -> None:
    engines = [
        EngineConfig(name="decode-a", kind="sim", role=EngineRole.CONSUMER, model="sim-m"),
        EngineConfig(name="decode-b", kind="sim", role=EngineRole.CONSUMER, model="sim-m"),
        EngineConfig(name="prefill-a", kind="sim", role=EngineRole.PRODUCER, model="sim-m"),
    ]
    events = Events()
    sup = Supervisor(engines, launcher(tmp_path), host_has_gpu=False)
    try:
        urls = await sup.start(progress=events)
        status = {s.name: s for s in sup.status()}
        kill_leftovers.extend(running_pid(s) for s in status.values())
        # Two identical consumers share one process; the producer has its own.
        assert set(status) == {"decode-a", "prefill-a"}
        assert status["decode-a"].engines == ("decode-a", "decode-b")
        assert all(s.state == HEALTHY for s in status.values())
        assert set(urls) == {"decode-a", "decode-b", "prefill-a"}
        assert len({u for u in urls.values()}) == 3
        for url in urls.values():
            assert await get_status(f"{url}/health") == 200
        logs = tmp_path / "logs"
        assert (logs / "decode-a.log").is_file()
        assert (logs / "prefill-a.log").is_file()
        assert os.readlink(logs / "decode-b.log") == "decode-a.log"

        old_pid = running_pid(status["prefill-a"])
        mark = len(events.seen)
        os.kill(old_pid, signal.SIGKILL)
        await events.next("prefill-a", "restarting", after=mark)
        await events.next("prefill-a", HEALTHY, after=mark)
        restarted = {s.name: s for s in sup.status()}["prefill-a"]
        kill_leftovers.append(running_pid(restarted))
        assert restarted.pid != old_pid
        assert restarted.restarts == 1
        assert restarted.last_exit_code == -signal.SIGKILL
        # Same port after the restart: the router's URL stays valid.
        assert await get_status(f"{urls['prefill-a']}/health") == 200
        assert "attempt 2" in (logs / "prefill-a.log").read_text()
        pids = group_pids(sup)
    finally:
        await sup.stop()
    assert all(s.state == "stopped" and s.pid is None for s in sup.status())
    # stop() returns only once every process group is gone.
    assert all(pid_gone(p) and group_gone(p) for p in pids)


async def test_free_ports_are_distinct_and_held_until_spawn(tmp_path: Path, fake_python: str) -> None:
    engines = [EngineConfig(name=f"e{i}", kind="sim") for i in range(2)] + [
        EngineConfig(name="v", kind="vllm", model="/m")
    ]
    sup = Supervisor(engines, launcher(tmp_path), host_has_gpu=False, python=fake_python)
    sup.plan()
    ports = sup.ports
    picked = [ports["e0"].http, ports["e1"].http, ports["v"].http, ports["v"].nixl]
    assert len(set(picked)) == 4
    assert all(p is not None and p > 0 for p in picked)
    # Held: nobody else can bind a picked port before the engine is spawned.
    import socket

    with socket.socket() as s, pytest.raises(OSError, match="Address already in use"):
        s.bind(("127.0.0.1", ports["e0"].http))
    await sup.stop()  # releases the reservations
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports["e0"].http))


async def test_side_channel_host_that_is_not_local_still_gets_a_port(tmp_path: Path) -> None:
    # 192.0.2.0/24 (TEST-NET-1) is never an address of this machine.
    engines = [EngineConfig(name="v", kind="vllm", model="/m", port=9100, nixl_side_channel_host="192.0.2.10")]
    sup = Supervisor(engines, launcher(tmp_path), host_has_gpu=False)
    (cmd,) = sup.plan()
    sup.release_ports()
    assert cmd.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.0.2.10"
    nixl = sup.ports["v"].nixl
    assert nixl is not None
    assert int(cmd.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == nixl > 0


async def test_start_failure_raises_with_log_tail_and_leaves_nothing(tmp_path: Path, fake_python: str) -> None:
    engines = [
        EngineConfig(name="ok", kind="sim", env=(("FAKE_MODE", "serve"),)),
        EngineConfig(name="bad", kind="sim", env=(("FAKE_MODE", "exit"),)),
    ]
    sup = Supervisor(engines, launcher(tmp_path), host_has_gpu=False, python=fake_python)
    with pytest.raises(EngineStartError) as err:
        await sup.start()
    assert err.value.name == "bad"
    assert "exited with code 3" in str(err.value)
    assert "fatal: simulated start-up failure" in err.value.log_tail
    assert err.value.log_file == str(tmp_path / "logs" / "bad.log")
    # The healthy engine was stopped too.
    assert all(s.state == "stopped" and s.pid is None for s in sup.status())


async def test_startup_timeout_kills_the_hung_engine(
    tmp_path: Path, fake_python: str, kill_leftovers: list[int]
) -> None:
    engines = [EngineConfig(name="hung", kind="sim", env=(("FAKE_MODE", "hang"),))]
    events = Events()
    # 3 s: long enough for the fake engine's interpreter to start and log on a loaded machine.
    sup = Supervisor(engines, launcher(tmp_path, startup_timeout_s=3.0), host_has_gpu=False, python=fake_python)
    start = asyncio.create_task(sup.start(progress=events))
    ev = await events.next("hung", "starting")
    pid = next(running_pid(s) for s in sup.status())
    kill_leftovers.append(pid)
    with pytest.raises(EngineStartError, match=r"did not answer GET /health within 3 s"):
        await start
    assert ev.detail == "attempt 1"
    assert "fake engine hang" in await asyncio.to_thread((tmp_path / "logs" / "hung.log").read_text)
    assert pid_gone(pid)
    assert group_gone(pid)


async def test_stop_escalates_to_sigkill_for_the_whole_group(
    tmp_path: Path, fake_python: str, kill_leftovers: list[int]
) -> None:
    pid_file = tmp_path / "pids"
    engines = [
        EngineConfig(name="stubborn", kind="sim", env=(("FAKE_MODE", "stubborn"), ("FAKE_PID_FILE", str(pid_file))))
    ]
    sup = Supervisor(engines, launcher(tmp_path), host_has_gpu=False, python=fake_python, stop_timeout_s=0.5)
    await sup.start()
    leader = next(running_pid(s) for s in sup.status())
    kill_leftovers.append(leader)
    engine_pid, grandchild = map(int, pid_file.read_text().split())
    assert not pid_gone(grandchild)
    await sup.stop()
    # Both ignore SIGTERM; the group SIGKILL reached the grandchild as well.
    assert pid_gone(engine_pid)
    assert pid_gone(grandchild)
    assert group_gone(leader)


async def test_gives_up_after_max_restarts(tmp_path: Path, fake_python: str, kill_leftovers: list[int]) -> None:
    engines = [EngineConfig(name="flaky", kind="sim", env=(("FAKE_MODE", "serve"),))]
    events = Events()
    sup = Supervisor(
        engines, launcher(tmp_path, max_restarts=1, restart_backoff_s=0.0), host_has_gpu=False, python=fake_python
    )
    try:
        await sup.start(progress=events)
        first = next(running_pid(s) for s in sup.status())
        kill_leftovers.append(first)
        mark = len(events.seen)
        os.kill(first, signal.SIGKILL)
        await events.next("flaky", HEALTHY, after=mark)
        second = next(running_pid(s) for s in sup.status())
        kill_leftovers.append(second)
        mark = len(events.seen)
        os.kill(second, signal.SIGKILL)
        failed = await events.next("flaky", FAILED, after=mark)
        assert "gave up after 1 restart(s)" in failed.detail
        # wait() returns once every process has been given up.
        await asyncio.wait_for(sup.wait(), EVENT_TIMEOUT_S)
        (st,) = sup.status()
        assert st.state == FAILED
        assert st.pid is None
        assert st.restarts == 1
    finally:
        await sup.stop()
    states = [e.state for e in events.seen]
    assert states == [
        "starting",
        "healthy",
        "exited",
        "restarting",
        "starting",
        "healthy",
        "exited",
        "failed",
        "stopped",
    ]


async def test_host_type_can_be_forced_either_way(tmp_path: Path) -> None:
    from engine_launcher.host import HostInfo

    engines = [
        EngineConfig(name=n, kind="vllm", role=r, model="/m", port=p, nixl_side_channel_port=p + 100)
        for n, r, p in (("p", EngineRole.PRODUCER, 9001), ("c", EngineRole.CONSUMER, 9002))
    ]
    # GPU command lines printed on a machine without GPUs: one GPU per engine is assumed.
    sup = Supervisor(engines, launcher(tmp_path), host_has_gpu=True, host=HostInfo(gpu_count=0, cpu_ids=(0, 1)))
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in sup.plan()] == ["0", "1"]
    sup.release_ports()  # planned, never started: the picked ports are let go, as --dry-run does
    # The CPU build forced on a GPU machine.
    sup = Supervisor(engines, launcher(tmp_path), host_has_gpu=False, host=HostInfo(gpu_count=8, cpu_ids=(0, 1, 2, 3)))
    assert [c.env["VLLM_CPU_OMP_THREADS_BIND"] for c in sup.plan()] == ["0,1", "2,3"]
    assert all("CUDA_VISIBLE_DEVICES" not in c.env for c in sup.plan())
    sup.release_ports()


async def test_restarts_that_never_get_healthy_count_and_back_off(
    tmp_path: Path, fake_python: str, kill_leftovers: list[int]
) -> None:
    engines = [
        EngineConfig(
            name="once", kind="sim", env=(("FAKE_MODE", "serve-once"), ("FAKE_MARKER", str(tmp_path / "started")))
        )
    ]
    events = Events()
    sup = Supervisor(
        engines, launcher(tmp_path, max_restarts=2, restart_backoff_s=0.01), host_has_gpu=False, python=fake_python
    )
    try:
        await sup.start(progress=events)
        first = next(running_pid(s) for s in sup.status())
        kill_leftovers.append(first)
        mark = len(events.seen)
        os.kill(first, signal.SIGKILL)
        failed = await events.next("once", FAILED, after=mark)
        assert "gave up after 2 restart(s); exit code 3" in failed.detail
    finally:
        await sup.stop()
    after = [(e.state, e.detail) for e in events.seen[mark:]]
    assert after == [
        ("exited", "exit code -9"),
        ("restarting", "exit code -9; restart 1/2 in 0.0 s"),
        ("starting", "attempt 2"),
        ("exited", "exited with code 3 before it was healthy"),
        ("restarting", "exit code 3; restart 2/2 in 0.0 s"),
        ("starting", "attempt 3"),
        ("exited", "exited with code 3 before it was healthy"),
        ("failed", failed.detail),
        ("stopped", ""),
    ]
    assert "fatal: cannot start again" in (tmp_path / "logs" / "once.log").read_text()
