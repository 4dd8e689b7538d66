"""Fixtures for the simulator tests: engines started in-process on free ports and closed
at teardown, an HTTP session (helpers: support/sim_http.py), and for the KV event tests a
ZeroMQ context and `sim`, an engine with its event stream subscribed
(support/sim_kv_events.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

from engine_launcher.sim import SimEngineConfig, SimEngineHandle, start_sim_engine
from support.sim_http import MakeEngine
from support.sim_kv_events import StartSim, Subscriber, events_config

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


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
async def sim(
    make_engine: MakeEngine, zctx: zmq.asyncio.Context, http: aiohttp.ClientSession
) -> AsyncIterator[StartSim]:
    subscribers: list[Subscriber] = []

    async def start(**kw: Any) -> Subscriber:
        kw.setdefault("kv_events_config", events_config())
        sub = Subscriber(zctx, await make_engine(**kw))
        subscribers.append(sub)
        await sub.ready(http)
        return sub

    yield start
    for sub in subscribers:  # closed before the test's references go: no socket is leaked
        sub.sock.close(linger=0)
