"""The scripted engine server of the hand-written client's tests, one per test, and the
client under test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from router.config.schema import TimeoutsConfig
from router.engine.client import UpstreamClient
from support.raw_server import Answer, RawServer


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Answer], Awaitable[RawServer]]]:
    servers: list[RawServer] = []

    async def start(answer: Answer) -> RawServer:
        s = RawServer(answer)
        await s.start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        await s.stop()


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(TimeoutsConfig())
    yield c
    await c.close()
