"""Fixtures for the simulator tests: engines started in-process on free ports and closed
at teardown, and an HTTP session (helpers: support/sim_http.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from engine_launcher.sim import SimEngineConfig, SimEngineHandle, start_sim_engine

# Fast by default: 1000x time compression keeps every test short.
FAST = 1000.0


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Awaitable[SimEngineHandle]]]:
    started: list[SimEngineHandle] = []

    async def make(**kw: Any) -> SimEngineHandle:
        kw.setdefault("speed", FAST)
        kw.setdefault("max_model_len", 2048)
        kw.setdefault("num_gpu_blocks", 4096)
        eng = await start_sim_engine(SimEngineConfig(**kw))
        started.append(eng)
        return eng

    yield make
    for eng in started:
        await eng.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s
