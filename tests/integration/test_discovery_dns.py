"""Engines found through DNS, against a real DNS server (dnsmasq).

A `[[discovery]]` table names a DNS name; every address it resolves to is an engine on the
table's port. An address that appears joins once its health check passes; one that
vanishes is drained (its running stream finishes) and removed; a DNS server that stops
answering changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from engine_launcher.sim import SimEngineConfig, SimEngineHandle, start_sim_engine
from router.server.state import RouterState
from support.cluster import MODEL, long_prompt, registry_of
from support.dns_server import DnsServer
from support.fleet import ADDRS, finished, start_router
from support.polling import eventually
from support.ports import free_port_on

NAME = "engines.fleet.test"


# What `dns_router` gives: the engines' port, `start_engine(addr)`, `start()` (a router
# following the DNS name: its state and URL) and an HTTP session.
DnsRouter = tuple[
    int,
    Callable[..., Awaitable[SimEngineHandle]],
    Callable[..., Awaitable[tuple[RouterState, str]]],
    aiohttp.ClientSession,
]


@pytest.fixture
async def dns_router(dns_server: DnsServer) -> AsyncIterator[DnsRouter]:
    port = free_port_on(ADDRS)
    engines: dict[str, SimEngineHandle] = {}
    runners: list[web.AppRunner] = []
    session = aiohttp.ClientSession()

    async def start_engine(addr: str, speed: float = 50.0) -> SimEngineHandle:
        engines[addr] = await start_sim_engine(
            SimEngineConfig(model=MODEL, speed=speed, role="consumer"), host=addr, port=port
        )
        return engines[addr]

    async def start(interval_s: float = 0.2) -> tuple[RouterState, str]:
        return await start_router(
            {
                "server": {"port": 0},
                "health": {"scrape_interval_s": 0.2, "check_interval_s": 0.4},
                "discovery": [
                    {
                        "kind": "dns",
                        "name": NAME,
                        "port": port,
                        "role": "decode",
                        "models": [MODEL],
                        "interval_s": interval_s,
                        "nameservers": [dns_server.nameserver],
                    }
                ],
            },
            runners,
        )

    yield port, start_engine, start, session
    await session.close()
    for r in runners:
        await r.cleanup()
    for e in engines.values():
        await e.close()


def backend(addr: str, port: int) -> str:
    return f"{NAME}@{addr}:{port}"


async def complete(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 2
) -> tuple[int, dict[str, Any]]:
    async with session.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    ) as r:
        answer: dict[str, Any] = orjson.loads(await r.read())
        return r.status, answer


async def test_addresses_that_appear_join_and_those_that_vanish_are_drained(
    dns_server: DnsServer, dns_router: DnsRouter
) -> None:
    port, start_engine, start_router, session = dns_router
    a, b, dead = ADDRS[:3]
    first = await start_engine(a)
    second = await start_engine(b, speed=0.5)  # slow: its stream is still running when it vanishes
    await dns_server.publish({NAME: [a]})
    state, url = await start_router()
    # Found before serving: the first round runs at start, like the first health round.
    assert set(registry_of(state).states) == {backend(a, port)}
    assert registry_of(state).states[backend(a, port)].healthy
    assert (await complete(session, url, "hello"))[0] == 200

    # A new address, and one where nothing listens: only the one that answers joins, and
    # it is healthy from the moment it appears (its check ran first).
    seen_unhealthy = []

    def joined() -> bool:
        s = registry_of(state).states.get(backend(b, port))
        if s is not None and not s.healthy:
            seen_unhealthy.append(True)
        return s is not None

    await dns_server.publish({NAME: [a, b, dead]})
    await eventually(joined, within=15, what="the new address to join")
    assert not seen_unhealthy
    discovery = state.discovery
    assert discovery is not None  # [[discovery]] configured
    rounds = discovery.rounds[f"discovery:dns:{NAME}"]
    await eventually(
        lambda: discovery.rounds[f"discovery:dns:{NAME}"] >= rounds + 3, within=15, what="more discovery rounds"
    )
    assert backend(dead, port) not in registry_of(state).states

    # The first engine is drained by hand so the stream lands on the second.
    registry_of(state).set_draining(backend(a, port), True)
    stream = asyncio.create_task(complete(session, url, long_prompt("dns", 40), max_tokens=60))
    await eventually(lambda: second.engine.num_running > 0 or stream.done(), within=15, what="the stream to start")
    assert not stream.done()
    registry_of(state).set_draining(backend(a, port), False)

    # The second address vanishes from DNS while its stream runs.
    await dns_server.publish({NAME: [a]})
    await eventually(
        lambda: (
            registry_of(state).states.get(backend(b, port)) is None
            or registry_of(state).states[backend(b, port)].draining
        ),
        within=15,
        what="the drain",
    )
    assert not stream.done(), "the stream must still be running when the drain starts"
    status, out = await stream
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 60, out
    await eventually(lambda: backend(b, port) not in registry_of(state).states, within=15, what="the removal")
    before = {e: await finished(session, e) for e in (first, second)}
    for i in range(3):
        assert (await complete(session, url, f"after {i}"))[0] == 200
    assert await finished(session, second) == before[second]
    assert await finished(session, first) >= before[first] + 3


async def test_nxdomain_removes_the_engines_and_an_outage_keeps_them(
    dns_server: DnsServer, dns_router: DnsRouter
) -> None:
    port, start_engine, start_router, session = dns_router
    a = ADDRS[0]
    await start_engine(a)
    await dns_server.publish({NAME: [a]})
    state, url = await start_router()
    source = f"discovery:dns:{NAME}"
    assert set(registry_of(state).states) == {backend(a, port)}

    await dns_server.publish({})  # the name is gone (NXDOMAIN): an answer, zero engines
    await eventually(lambda: not registry_of(state).states, within=15, what="the removal")
    async with session.get(url + "/ready") as r:
        assert r.status == 503
    status, out = await complete(session, url, "nobody home")
    assert status == 503, out

    await dns_server.publish({NAME: [a]})
    await eventually(lambda: backend(a, port) in registry_of(state).states, within=15, what="the address to come back")
    assert (await complete(session, url, "back"))[0] == 200

    dns_server.close()  # the DNS server is gone: look-ups time out
    discovery = state.discovery
    assert discovery is not None  # [[discovery]] configured
    failures = discovery.failures.get(source, 0)
    await eventually(lambda: discovery.failures.get(source, 0) >= failures + 2, within=15, what="failed look-ups")
    assert set(registry_of(state).states) == {backend(a, port)}
    assert not registry_of(state).states[backend(a, port)].draining
    assert (await complete(session, url, "during the outage"))[0] == 200
