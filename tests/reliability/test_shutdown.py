"""Graceful shutdown (issue 6, item 5): `router --config X` gets SIGTERM.

It stops accepting at once, lets the streams in flight finish within
server.drain_timeout_s, cancels what outlasts it cleanly (an error event then [DONE], the
engine request aborted), stops the engines it started, and exits 0.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket

import aiohttp
import orjson

from relutil import MODEL, wait_for

ADMIN = "admin-key"


def _refuses(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(("127.0.0.1", port))
        except (ConnectionRefusedError, OSError):
            return True
    return False


async def _open_stream(s: aiohttp.ClientSession, url: str, max_tokens: int):
    r = await s.post(url + "/v1/completions", json={
        "model": MODEL, "prompt": "drain me", "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status == 200
    first = await r.content.readline()  # the stream has started
    assert first.startswith(b"data: ")
    return r, first


async def _read_rest(r: aiohttp.ClientResponse, first: bytes) -> list:
    raw = first + await r.content.read()
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            p = block[6:]
            out.append("[DONE]" if p == b"[DONE]" else orjson.loads(p))
    return out


def _router_config(tmp_path, drain_s: float, speed: float) -> dict:
    return {
        "server": {"drain_timeout_s": drain_s, "admin_api_key": ADMIN},
        "launcher": {"log_dir": str(tmp_path / "engine-logs"), "startup_timeout_s": 60.0},
        "engines": [{"name": "e0", "kind": "sim", "role": "both", "model": MODEL,
                     "extra_args": ["--speed", str(speed)]}],
    }


async def _engine_ports(s: aiohttp.ClientSession, url: str) -> list[int]:
    async with s.get(url + "/admin/backends", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        return [int(b["url"].rsplit(":", 1)[1]) for b in orjson.loads(await r.read())]


async def test_sigterm_lets_a_stream_finish_within_the_drain_and_stops_the_engines(procs, tmp_path):
    # speed 0.3: ~40 ms per token, so 60 tokens take a couple of seconds, well inside 20 s.
    router = procs.router(_router_config(tmp_path, drain_s=20.0, speed=0.3), extra_args=[])
    async with aiohttp.ClientSession() as s:
        ports = await _engine_ports(s, router.url)
        r, first = await _open_stream(s, router.url, max_tokens=60)
        os.kill(router.proc.pid, signal.SIGTERM)
        # Not accepting any more, while the stream goes on.
        await wait_for(lambda: _refuses(router.port), 5, "listening socket closed")
        async with asyncio.timeout(30):
            events = await _read_rest(r, first)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
        assert events[-2]["usage"]["completion_tokens"] == 60
        r.release()
    rc = await asyncio.to_thread(router.proc.wait, 30)
    assert rc == 0, router.log_tail()
    assert all(_refuses(p) for p in ports), "the router's engines are still listening"
    assert "draining 1 request" in router.log_path.read_text()


async def test_sigterm_cancels_a_stream_that_outlasts_the_drain_cleanly(procs, tmp_path):
    # speed 0.02: a token every ~0.3 s; 400 tokens would take minutes, the drain is 1.5 s.
    router = procs.router(_router_config(tmp_path, drain_s=1.5, speed=0.02), extra_args=[])
    async with aiohttp.ClientSession() as s:
        ports = await _engine_ports(s, router.url)
        engine_url = f"http://127.0.0.1:{ports[0]}"
        r, first = await _open_stream(s, router.url, max_tokens=400)
        os.kill(router.proc.pid, signal.SIGTERM)
        async with asyncio.timeout(20):
            events = await _read_rest(r, first)
        r.release()
        assert events[-1] == "[DONE]", events[-3:]
        err = events[-2]["error"]
        assert err["code"] == 503 and "shutting down" in err["message"] and "drain_timeout_s" in err["message"]
        rc = await asyncio.to_thread(router.proc.wait, 30)
        assert rc == 0, router.log_tail()
        assert _refuses(ports[0]), f"engine {engine_url} still listening"
    assert "cancelling 1 request" in router.log_path.read_text()
