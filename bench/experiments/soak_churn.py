"""The soak's fleet churn: SIGHUP reloads that add, remove and replace backends (flip-flops
included), admin adds, deletes, drains and enables, and an engine that stalls (SIGSTOP for
1.5 s of every 3 s, in bursts). Every step is logged with its time; at the end the fleet
is put back to the base configuration, so the gauges and the backend list can be checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import tomli_w

from bench.experiments.soak_procs import MODEL, Engine

ADMIN_KEY = "soak-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
RELOADED = "r0"  # the backend name reloads add, move and remove
ADMIN_ADDED = "x0"  # the backend name the admin API adds and deletes
STALL_PAUSE_S, STALL_PERIOD_S = 1.5, 3.0


def backend(name: str, e: Engine) -> dict[str, Any]:
    return {"name": name, "url": e.url, "role": "decode", "models": [MODEL]}


@dataclass
class Churn:
    """What the churn did, and the state it must undo at the end."""

    config: dict[str, Any]  # router.toml as written at the start
    config_path: Path
    router: subprocess.Popen[bytes]
    url: str
    base: list[Engine]
    spares: list[Engine]
    t0: float
    rng: random.Random
    steps: list[tuple[float, str]] = field(default_factory=list)
    reloaded_at: Engine | None = None  # where RELOADED points in the config, None: not in it
    drained: str | None = None

    def note(self, what: str) -> None:
        t = time.monotonic() - self.t0
        self.steps.append((t, what))
        print(f"[{t:7.1f}s] churn: {what}", flush=True)

    # --- SIGHUP ----------------------------------------------------------------------------
    def reload(self, at: Engine | None) -> None:
        backends = [backend(e.name, e) for e in self.base]
        if at is not None:
            backends.append(backend(RELOADED, at))
        self.config_path.write_text(tomli_w.dumps({**self.config, "backends": backends}))
        self.reloaded_at = at
        os.kill(self.router.pid, signal.SIGHUP)  # the router's own pid, not its group

    async def flip_flop(self) -> None:
        a, b = self.spares[0], self.spares[1 % len(self.spares)]
        for at in (a, b, a, b):
            self.reload(at)
            await asyncio.sleep(0.2)
        self.note(f"reload flip-flop {RELOADED}: {a.name} -> {b.name} -> {a.name} -> {b.name}")

    # --- admin API ---------------------------------------------------------------------------
    async def admin(self, s: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> int:
        async with s.request(method, self.url + path, json=body, headers=ADMIN) as r:
            await r.read()
            return r.status

    async def step(self, s: aiohttp.ClientSession) -> None:
        spare = self.rng.choice(self.spares)
        actions: list[tuple[str, Callable[[], Any]]] = [
            ("reload add/replace", lambda: self.reload(spare)),
            ("reload remove", lambda: self.reload(None)),
            ("reload flip-flop", self.flip_flop),
            ("admin add", lambda: self.admin(s, "POST", "/admin/backends", backend(ADMIN_ADDED, spare))),
            ("admin delete", lambda: self.admin(s, "DELETE", f"/admin/backends/{ADMIN_ADDED}")),
            ("admin drain/enable", lambda: self.drain_toggle(s)),
        ]
        what, act = self.rng.choice(actions)
        out = act()
        if asyncio.iscoroutine(out):
            out = await out
        if what.startswith("reload") and what != "reload flip-flop":
            self.note(f"{what}: {RELOADED} -> {self.reloaded_at.name if self.reloaded_at else 'gone'}")
        elif what.startswith("admin") and what != "admin drain/enable":
            self.note(f"{what} {ADMIN_ADDED} ({spare.name}): HTTP {out}")

    async def drain_toggle(self, s: aiohttp.ClientSession) -> None:
        if self.drained is None:
            self.drained = self.rng.choice(self.base).name
            status = await self.admin(s, "POST", f"/admin/backends/{self.drained}/drain")
            self.note(f"admin drain {self.drained}: HTTP {status}")
        else:
            status = await self.admin(s, "POST", f"/admin/backends/{self.drained}/enable")
            self.note(f"admin enable {self.drained}: HTTP {status}")
            self.drained = None

    async def undo(self, s: aiohttp.ClientSession) -> None:
        """Back to the base fleet: the reloaded and admin-added backends go, drains end."""
        if self.drained is not None:
            await self.admin(s, "POST", f"/admin/backends/{self.drained}/enable")
            self.drained = None
        await self.admin(s, "DELETE", f"/admin/backends/{ADMIN_ADDED}")
        self.reload(None)
        self.note("undo: base configuration, admin backend deleted, drains ended")


async def churner(churn: Churn, s: aiohttp.ClientSession, every_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(every_s * churn.rng.uniform(0.5, 1.5)):
                await stop.wait()
        if not stop.is_set():
            try:
                await churn.step(s)
            except (aiohttp.ClientError, OSError) as e:  # the soak goes on; the step is logged
                churn.note(f"step failed: {e!r}")


async def staller(churn: Churn, engine: Engine, burst_s: float, stop: asyncio.Event) -> None:
    """SIGSTOP/SIGCONT `engine` (STALL_PAUSE_S of every STALL_PERIOD_S) for `burst_s`, then
    leave it alone as long, and again (the fault schedule: fixed sleeps on purpose)."""

    def send(sig: int) -> None:
        if engine.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(engine.proc.pid, sig)

    try:
        while not stop.is_set():
            churn.note(f"{engine.name} stalls for {burst_s:g} s")
            end = time.monotonic() + burst_s
            while time.monotonic() < end and not stop.is_set():
                send(signal.SIGSTOP)
                await asyncio.sleep(STALL_PAUSE_S)
                send(signal.SIGCONT)
                await asyncio.sleep(STALL_PERIOD_S - STALL_PAUSE_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(burst_s):
                    await stop.wait()
    finally:
        send(signal.SIGCONT)


async def backends_listed(churn: Churn, s: aiohttp.ClientSession) -> list[str]:
    async with s.get(churn.url + "/admin/backends", headers=ADMIN) as r:
        return sorted(b["name"] for b in await r.json())
