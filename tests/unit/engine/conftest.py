"""The scripted engine server of the hand-written client's tests, one per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

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
