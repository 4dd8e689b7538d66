"""Helpers of the fleet tests: engines sharing one port on several loopback addresses (as
pods or DNS records share a container port), routers started from a raw configuration,
and how many requests an engine finished (ports and polling: the support package)."""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

from engine_launcher.sim import SimEngineHandle
from router.config.parse import parse_config
from router.server.app import ROUTER_KEY, build_app
from router.server.state import RouterState
from support.metrics import scrape_metrics
from support.ports import site_port

ADDRS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")


async def finished(session: aiohttp.ClientSession, engine: SimEngineHandle) -> float:
    """Requests an engine finished (vllm:request_success_total), from its own /metrics."""
    return (await scrape_metrics(session, engine.url)).value("vllm:request_success_total")


async def start_router(raw: dict[str, Any], runners: list[web.AppRunner]) -> tuple[RouterState, str]:
    """A router serving `raw` on a free loopback port: (its RouterState, its URL)."""
    app = build_app(parse_config(raw), start_engines=False)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    runners.append(runner)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return app[ROUTER_KEY], f"http://127.0.0.1:{site_port(site)}"
