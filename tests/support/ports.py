"""Ports free to bind on loopback.

A port found free can still be taken by another process before the test's server binds it;
callers that start a separate process retry on "Address already in use" where it matters.
"""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

from aiohttp import web

_rng = random.Random()


def free_port(host: str = "127.0.0.1", *, udp: bool = False) -> int:
    """A TCP port free on `host` now; with udp=True free for both UDP and TCP (a DNS server
    listens on both)."""
    if not udp:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port: int = s.getsockname()[1]
            return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind((host, 0))
            port = int(u.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                try:
                    t.bind((host, port))
                except OSError:
                    continue
                return port


def free_port_on(hosts: tuple[str, ...] | list[str], attempts: int = 20) -> int:
    """A TCP port free on every address in `hosts` (engines sharing one port on several
    loopback addresses, as pods share a container port)."""
    for _ in range(attempts):
        port = free_port(hosts[0])
        try:
            for host in hosts:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {hosts}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port_below_ephemeral_range(host: str = "127.0.0.1") -> int:
    """A TCP port free now, chosen below the kernel's ephemeral range.

    Port 0 gives an ephemeral port, which any outgoing connection on a busy machine may take
    before a slow-starting server binds it (NIXL's handshake listener failed with "Address
    already in use" that way). Ports below the ephemeral range are only taken by listeners.
    """
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = _rng.randrange(20000, max(low, 20001))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


def site_port(site: web.TCPSite) -> int:
    """The port a started aiohttp site listens on (it was started on port 0)."""
    server = site._server
    assert isinstance(server, asyncio.Server)  # started: a listening server
    port: int = server.sockets[0].getsockname()[1]
    return port


async def serve_on_free_port(app: web.Application, *, cancel_handlers: bool = False) -> tuple[web.AppRunner, str]:
    """`app` listening on a free loopback port: its runner (clean up with `cleanup()`) and
    base URL. `cancel_handlers`: a client's hang-up cancels its handler, as the router runs."""
    runner = web.AppRunner(app, handler_cancellation=cancel_handlers)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site_port(site)}"
