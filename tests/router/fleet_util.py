"""Helpers of the fleet tests: engines sharing one port on several loopback addresses (as
pods or DNS records share a container port), routers started from a raw configuration,
and polling for conditions."""
from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

from router.app import ROUTER_KEY, build_app
from router.config import parse_config

ADDRS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")


def common_port(addrs=ADDRS) -> int:
    """A TCP port free on every address in `addrs`."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind((addrs[0], 0))
            port = s.getsockname()[1]
        try:
            for a in addrs:
                with socket.socket() as s:
                    s.bind((a, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no common free port")


async def wait_for(cond, timeout: float = 15.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() >= end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def finished(session: aiohttp.ClientSession, engine) -> float:
    """Requests an engine finished (vllm:request_success_total), from its own /metrics."""
    async with session.get(engine.url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


async def start_router(raw: dict, runners: list) -> tuple[object, str]:
    """A router serving `raw` on a free loopback port: (its RouterState, its URL)."""
    app = build_app(parse_config(raw), start_engines=False)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    runners.append(runner)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return app[ROUTER_KEY], f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
