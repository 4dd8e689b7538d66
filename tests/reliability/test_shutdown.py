"""Graceful shutdown: `router --config X` gets SIGTERM.

It stops accepting at once, lets the streams in flight finish within
server.drain_timeout_s, cancels what outlasts it cleanly (an error event then [DONE], the
engine request aborted), stops the engines it started, and exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from support.polling import eventually
from support.subprocess_cluster import MODEL

if TYPE_CHECKING:
    from reliability.conftest import Procs  # the `procs` fixture's value

ADMIN = "admin-key"


def _refuses(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(("127.0.0.1", port))
        except (ConnectionRefusedError, OSError):
            return True
    return False


async def _open_stream(s: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[aiohttp.ClientResponse, bytes]:
    r = await s.post(
        url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "drain me",
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status == 200
    first = await r.content.readline()  # the stream has started
    assert first.startswith(b"data: ")
    return r, first


async def _read_rest(r: aiohttp.ClientResponse, first: bytes) -> list[Any]:
    raw = first + await r.content.read()
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            p = block[6:]
            out.append("[DONE]" if p == b"[DONE]" else orjson.loads(p))
    return out


def _router_config(tmp_path: Path, drain_s: float, speed: float) -> dict[str, Any]:
    return {
        "server": {"drain_timeout_s": drain_s, "admin_api_key": ADMIN},
        "launcher": {"log_dir": str(tmp_path / "engine-logs"), "startup_timeout_s": 60.0},
        "engines": [
            {"name": "e0", "kind": "sim", "role": "both", "model": MODEL, "extra_args": ["--speed", str(speed)]}
        ],
    }


async def _engine_ports(s: aiohttp.ClientSession, url: str) -> list[int]:
    async with s.get(url + "/admin/backends", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        return [int(b["url"].rsplit(":", 1)[1]) for b in orjson.loads(await r.read())]


async def test_sigterm_lets_a_stream_finish_within_the_drain_and_stops_the_engines(
    procs: Procs, tmp_path: Path
) -> None:
    # speed 0.3: ~40 ms per token, so 60 tokens take a couple of seconds, well inside 20 s.
    router = procs.router(_router_config(tmp_path, drain_s=20.0, speed=0.3), extra_args=[])
    async with aiohttp.ClientSession() as s:
        ports = await _engine_ports(s, router.url)
        r, first = await _open_stream(s, router.url, max_tokens=60)
        os.kill(router.process.pid, signal.SIGTERM)
        # Not accepting any more, while the stream goes on.
        await eventually(lambda: _refuses(router.port), 5, "listening socket closed")
        async with asyncio.timeout(30):
            events = await _read_rest(r, first)
        assert events[-1] == "[DONE]", events[-3:]
        assert not any("error" in e for e in events[:-1]), events[-3:]
        assert events[-2]["usage"]["completion_tokens"] == 60
        r.release()
    rc = await asyncio.to_thread(router.process.wait, 30)
    assert rc == 0, router.log_tail()
    assert all(_refuses(p) for p in ports), "the router's engines are still listening"
    assert "draining 1 request" in router.log_path.read_text()


async def test_sigterm_cancels_a_stream_that_outlasts_the_drain_cleanly(procs: Procs, tmp_path: Path) -> None:
    # speed 0.02: a token every ~0.3 s; 400 tokens would take minutes, the drain is 1.5 s.
    router = procs.router(_router_config(tmp_path, drain_s=1.5, speed=0.02), extra_args=[])
    async with aiohttp.ClientSession() as s:
        ports = await _engine_ports(s, router.url)
        engine_url = f"http://127.0.0.1:{ports[0]}"
        r, first = await _open_stream(s, router.url, max_tokens=400)
        os.kill(router.process.pid, signal.SIGTERM)
        async with asyncio.timeout(20):
            events = await _read_rest(r, first)
        r.release()
        assert events[-1] == "[DONE]", events[-3:]
        err = events[-2]["error"]
        assert err["code"] == 503
        assert "shutting down" in err["message"]
        assert "drain_timeout_s" in err["message"]
        rc = await asyncio.to_thread(router.process.wait, 30)
        assert rc == 0, router.log_tail()
        assert _refuses(ports[0]), f"engine {engine_url} still listening"
    assert "cancelling 1 request" in router.log_path.read_text()


async def _keep_alive_client(url: str, i: int, outcomes: list[Any], stop_sending: asyncio.Event) -> None:
    """One client on one keep-alive connection, sending streamed requests back to back
    until the router says it is shutting down or stops accepting connections."""
    body = {"model": MODEL, "prompt": f"keep-alive client {i}", "max_tokens": 30, "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        while True:
            try:
                async with s.post(url + "/v1/completions", json=body) as r:
                    raw = await r.read()
                    if r.status == 200 and raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw:
                        outcomes.append("completed")
                        if stop_sending.is_set():
                            return
                        continue
                    err = orjson.loads(raw)["error"] if r.status != 200 else {"code": 200}
                    outcomes.append(f"{r.status}" if err.get("code") == r.status else f"malformed {r.status}")
                    return
            except aiohttp.ClientConnectorError:
                outcomes.append("refused")  # a new connection, nothing was sent: fine
                return
            except aiohttp.ClientError as e:  # a request sent and then cut: lost
                outcomes.append(f"reset: {e!r}")
                return


async def test_sigterm_answers_503_on_open_keep_alive_connections(procs: Procs, tmp_path: Path) -> None:
    """Requests that clients send on their open keep-alive connections during the drain
    get 503 (then Connection: close), never a reset; the streams in flight complete."""
    engine = procs.sim("--speed", "1")
    router = procs.router(
        {
            "server": {"drain_timeout_s": 20.0},
            "backends": [{"name": "d0", "url": engine.url, "role": "decode", "models": [MODEL]}],
        }
    )
    outcomes: list[str] = []
    stop_sending = asyncio.Event()
    clients = [asyncio.create_task(_keep_alive_client(router.url, i, outcomes, stop_sending)) for i in range(24)]
    await eventually(lambda: outcomes.count("completed") >= 24, 30, "every client served once")
    os.kill(router.process.pid, signal.SIGTERM)
    async with asyncio.timeout(60):
        await asyncio.gather(*clients)
    rc = await asyncio.to_thread(router.process.wait, 30)
    assert rc == 0, router.log_tail()
    bad = [o for o in outcomes if o not in ("completed", "503", "refused")]
    assert not bad, (bad, len(outcomes))
    assert outcomes.count("503") >= 1, outcomes
