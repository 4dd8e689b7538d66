"""`python -m bench slow-readers`: router memory under streams whose clients never read.

Simulated engines and `router --config` run as processes. After a warm-up the router's
RSS is measured idle; then `--streams` clients each send one streamed request for
`--max-tokens` tokens and never read a byte of the answer (a small receive buffer, as a
stalled client has). RSS is sampled every second for `--hold-s` seconds, the clients then
close their connections, and RSS is measured again once the router's in-flight gauges are
back to 0. Bounded per-stream buffering (docs/RELIABILITY.md) keeps the router's memory
near N x the bound, not N x the answers' length.

Printed (and written to `--out`/slow_readers.json): RSS idle, the highest RSS under load
and its ratio to idle (target <= 2), RSS after, the engines' running counts under load
(backpressure holds the streams at the engines: they stay running, unread), and the
kernel's TCP memory (system-wide, /proc/net/sockstat) idle and under load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import tomli_w

from bench.harness.procs import PY, ProcessSet, RSSSampler, free_ports, wait_http

REPO = Path(__file__).resolve().parents[2]
MODEL = "sim-model"
MIB = 2**20


def _tcp_mem_mib() -> float | None:
    """The kernel's TCP buffer memory, all sockets of the machine (pages)."""
    import os

    try:
        with open("/proc/net/sockstat") as f:
            for line in f:
                if line.startswith("TCP:"):
                    parts = line.split()
                    return int(parts[parts.index("mem") + 1]) * os.sysconf("SC_PAGE_SIZE") / MIB
    except (OSError, ValueError):
        return None
    return None


async def _gauge(s: aiohttp.ClientSession, url: str, name: str) -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


async def _open_unread_stream(port: int, body: bytes, rcvbuf: int) -> socket.socket:
    """Connect with a small receive buffer, send one streamed request, never read."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(
        sock,
        (
            f"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body,
    )
    return sock


async def run(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    ports = free_ports(a.engines + 1)
    with ProcessSet(out / "logs") as ps:
        engines = []
        for i in range(a.engines):
            engines.append(
                (
                    f"d{i}",
                    ports[i],
                    ps.start(
                        f"d{i}",
                        [
                            PY,
                            "-m",
                            "engine_launcher.sim",
                            "--port",
                            str(ports[i]),
                            "--model",
                            MODEL,
                            "--speed",
                            str(a.speed),
                            "--max-num-seqs",
                            str(a.streams),
                            "--log-level",
                            "warning",
                        ],
                    ),
                )
            )
        for _name, port, p in engines:
            await wait_http(f"http://127.0.0.1:{port}/health", p)
        rport = ports[-1]
        cfg = {
            "server": {
                "port": rport,
                "host": "127.0.0.1",
                "max_concurrent_requests": 4 * a.streams,
                "max_queued_requests": 4 * a.streams,
                "stream_buffer_bytes": a.stream_buffer_bytes,
            },
            "timeouts": {"idle_s": a.idle_s, "total_s": max(a.idle_s, a.hold_s) * 4},
            "backends": [
                {"name": n, "url": f"http://127.0.0.1:{port}", "role": "decode", "models": [MODEL]}
                for n, port, _ in engines
            ],
        }
        (out / "router.toml").write_text(tomli_w.dumps(cfg))
        router = ps.start("router", [PY, "-m", "router.cli", "--config", str(out / "router.toml"), "--no-engines"])
        url = f"http://127.0.0.1:{rport}"
        await wait_http(url + "/ready", router)
        sampler = RSSSampler(router.pid)
        async with aiohttp.ClientSession() as s:
            # Warm-up: a few whole answers, so that idle memory includes what serving needs.
            for i in range(8):
                async with s.post(
                    url + "/v1/completions",
                    json={"model": MODEL, "prompt": f"warm up {i}", "max_tokens": 200, "stream": True},
                ) as r:
                    await r.read()
            await asyncio.sleep(1.0)
            idle = sampler.rss() / MIB
            tcp_idle = _tcp_mem_mib()
            body_of: Callable[[int], bytes] = lambda i: orjson.dumps(
                {
                    "model": MODEL,
                    "prompt": f"slow reader {i} " + "w " * 64,
                    "max_tokens": a.max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
            socks = [await _open_unread_stream(rport, body_of(i), a.rcvbuf) for i in range(a.streams)]
            timeline = []
            t0 = time.monotonic()
            peak = 0.0
            while time.monotonic() - t0 < a.hold_s:
                await asyncio.sleep(1.0)
                rss = sampler.rss() / MIB
                peak = max(peak, rss)
                inflight = await _gauge(s, url, "cachehit_router_inflight_requests")
                running = sum(
                    [await _gauge(s, f"http://127.0.0.1:{port}", "vllm:num_requests_running") for _, port, _ in engines]
                )
                timeline.append(
                    {
                        "t": round(time.monotonic() - t0, 1),
                        "rss_mib": round(rss, 1),
                        "inflight": inflight,
                        "engines_running": running,
                        "tcp_mem_mib": _tcp_mem_mib(),
                    }
                )
                if len(timeline) % 10 == 0:
                    print(
                        f"[{timeline[-1]['t']:5.0f}s] router RSS {rss:.1f} MiB, {inflight:.0f} streams open, "
                        f"{running:.0f} running at the engines",
                        flush=True,
                    )
            under = timeline[-1] if timeline else {}
            for sock in socks:
                sock.close()
            # Until the router has let go of every stream (it notices the closed sockets).
            drained = False
            for _ in range(300):
                if (
                    await _gauge(s, url, "cachehit_router_inflight_requests") == 0
                    and await _gauge(s, url, "cachehit_router_backend_inflight") == 0
                ):
                    drained = True
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(a.settle_s)
            after = sampler.rss() / MIB
    return {
        "config": vars(a),
        "rss_idle_mib": round(idle, 1),
        "rss_peak_under_load_mib": round(peak, 1),
        "peak_over_idle": round(peak / idle, 2),
        "rss_after_mib": round(after, 1),
        "after_over_idle": round(after / idle, 2),
        "streams_open_at_end_of_hold": under.get("inflight"),
        "engines_running_at_end_of_hold": under.get("engines_running"),
        "tcp_mem_idle_mib": tcp_idle,
        "tcp_mem_under_load_mib": under.get("tcp_mem_mib"),
        "gauges_back_to_0": drained,
        "timeline": timeline,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench slow-readers", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--hold-s", type=float, default=60.0, help="how long the clients stay connected, unread")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--speed", type=float, default=20.0, help="simulator speed factor")
    p.add_argument(
        "--idle-s",
        type=float,
        default=600.0,
        help="router timeouts.idle_s (longer than the hold, so that every stream stays open)",
    )
    p.add_argument("--rcvbuf", type=int, default=4096, help="the clients' SO_RCVBUF")
    p.add_argument("--stream-buffer-bytes", type=int, default=8 * 1024, help="router server.stream_buffer_bytes")
    p.add_argument("--settle-s", type=float, default=3.0, help="wait after the gauges drain before 'after'")
    p.add_argument("--out", help="output directory (default bench/out/slow-readers-<UTC time>)")
    a = p.parse_args(argv)
    out = Path(a.out or REPO / "bench" / "out" / time.strftime("slow-readers-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    res = asyncio.run(run(a, out))
    (out / "slow_readers.json").write_text(json.dumps(res, indent=2))
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"router memory, {a.streams} unread {a.max_tokens}-token streams for {a.hold_s:g} s")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in (
        "rss_idle_mib",
        "rss_peak_under_load_mib",
        "peak_over_idle",
        "rss_after_mib",
        "after_over_idle",
        "streams_open_at_end_of_hold",
        "engines_running_at_end_of_hold",
        "tcp_mem_idle_mib",
        "tcp_mem_under_load_mib",
        "gauges_back_to_0",
    ):
        v = res[k]
        t.add_row(k, f"{v:.1f}" if isinstance(v, float) else str(v))
    Console().print(t)
    print(f"results in {out}/slow_readers.json")
    return 0 if res["gauges_back_to_0"] else 1


if __name__ == "__main__":
    sys.exit(main())
