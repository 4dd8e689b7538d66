"""`python -m bench limits`: the router's memory against its documented bounds.

Simulated engines and `router --config` run as processes (docs/RELIABILITY.md, "Limits
and timeouts").

`--mode bodies`: every concurrency slot (`--slots`, the router's
server.max_concurrent_requests) filled with a maximal body (just under
server.max_body_bytes), first prompts of token ids, then text prompts, on slow simulated
engines (`--speed`: their prefill of such a prompt takes minutes, so every request stays in
flight). The clients send their request and never read. The bodies that fit in
server.max_body_bytes_in_flight are held at once, the rest wait for their turn. Printed per
kind: RSS idle, the peak while every slot is taken, the peak per body held, and the
documented bounds (`router.admission.body.memory_per_request_bound`, `memory_bound`).

`--mode heads`: `--connections` clients each send a request head of `--head-bytes`
(header lines of 8,000 bytes) and never the blank line. Printed: RSS idle, the peak, how
long until the router closed each connection (the size bound answers 431 at once, the
head timeout 408 after server.header_timeout_s; a client gives up after 3 x that + 10 s),
and RSS once they are closed (after the idle trim) against idle (target: within 10%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import tomli_w

from bench.harness.procs import PY, ProcessSet, RSSSampler, free_ports, wait_http
from router.admission.body import memory_bound, memory_per_request_bound
from router.config.schema import ServerConfig

REPO = Path(__file__).resolve().parents[2]
MODEL = "sim-model"
MIB = 2**20


def max_body(kind: str, index: int, max_bytes: int) -> bytes:
    """A completions body of `kind` ("token_ids" or "text") just under `max_bytes`."""
    rng = random.Random(index)
    head = {"model": MODEL, "max_tokens": 8, "stream": True}
    if kind == "token_ids":
        # ~7 bytes per id ("123456,"): ids in the simulator's vocabulary, all distinct prompts.
        n = (max_bytes - 200) // 7
        prompt: Any = [rng.randrange(100_000, 128_000) for _ in range(n)]
        body = orjson.dumps({**head, "prompt": prompt})
        while len(body) > max_bytes:
            prompt = prompt[: len(prompt) - (len(body) - max_bytes) // 6 - 1]
            body = orjson.dumps({**head, "prompt": prompt})
        return body
    # Words the simulator's tokenizer knows (one token each, ~4 bytes per token).
    words = f"request {index} " + "".join(rng.choice((" the", " of", " and", " to")) for _ in range(10))
    text = (words * (max_bytes // len(words) + 1))[: max_bytes - 200]
    return orjson.dumps({**head, "prompt": text})


async def _gauge(s: aiohttp.ClientSession, url: str, name: str) -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


async def _send_unread(port: int, body: bytes) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    await loop.sock_sendall(sock, head + body)
    return sock


def _start_cluster(ps: ProcessSet, a: argparse.Namespace, out: Path, server: dict[str, Any]) -> tuple[str, list[str]]:
    ports = free_ports(a.engines + 1)
    engines = []
    for i in range(a.engines):
        args = ["--port", str(ports[i]), "--model", MODEL, "--speed", str(a.speed), "--log-level", "warning"]
        # Room for a maximal prompt (text: ~2 bytes per token), in the KV cache too.
        max_len = a.max_body_bytes
        args += ["--max-model-len", str(max_len), "--num-gpu-blocks", str(max_len // 16 + 2)]
        args += ["--max-num-seqs", str(max(1, a.slots))]
        engines.append((f"d{i}", ports[i], ps.start(f"d{i}", [PY, "-m", "engine_launcher.sim", *args])))
    cfg = {
        "server": {"port": ports[-1], "host": "127.0.0.1", **server},
        "timeouts": {"first_token_s": 3600.0, "idle_s": 3600.0, "total_s": 7200.0},
        "backends": [
            {"name": n, "url": f"http://127.0.0.1:{port}", "role": "decode", "models": [MODEL]}
            for n, port, _ in engines
        ],
    }
    (out / "router.toml").write_text(tomli_w.dumps(cfg))
    ps.start("router", [PY, "-m", "router.cli", "--config", str(out / "router.toml"), "--no-engines"])
    return f"http://127.0.0.1:{ports[-1]}", [f"http://127.0.0.1:{p}" for _, p, _ in engines]


async def _ready(ps: ProcessSet, url: str, engine_urls: list[str]) -> int:
    for u in engine_urls:
        await wait_http(u + "/health")
    router = next(p for p in ps.procs if p.name == "router")
    await wait_http(url + "/ready", router)
    return int(router.pid)


async def _settled_rss(sampler: RSSSampler, settle_s: float) -> float:
    await asyncio.sleep(settle_s)  # the router trims its heap after 2 s idle (router/server/memtrim.py)
    return sampler.rss() / MIB


async def run_bodies(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    server = {
        "max_concurrent_requests": a.slots,
        "max_queued_requests": a.slots,
        "max_body_bytes": a.max_body_bytes,
        "max_body_bytes_in_flight": a.max_body_bytes_in_flight,
        "queue_timeout_s": a.timeout_s,  # requests past the body budget wait for their turn
    }
    cfg = ServerConfig(**{k: v for k, v in server.items() if k != "queue_timeout_s"})
    results: dict[str, Any] = {}
    with ProcessSet(out / "logs") as ps:
        url, engine_urls = _start_cluster(ps, a, out, server)
        sampler = RSSSampler(await _ready(ps, url, engine_urls))
        async with aiohttp.ClientSession() as s:

            async def warm(i: int) -> None:
                body = {"model": MODEL, "prompt": f"warm up {i}", "max_tokens": 1}
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()

            await asyncio.gather(*(warm(i) for i in range(4)))  # idle memory includes what serving needs
            idle = await _settled_rss(sampler, a.settle_s)
            for kind in ("token_ids", "text"):
                bodies = [max_body(kind, i, a.max_body_bytes) for i in range(a.slots)]
                # The requests whose bodies fit in the budget at once reach the engines.
                admitted = min(a.slots, a.max_body_bytes_in_flight // max(len(b) for b in bodies))
                sampler.start()
                t0 = time.monotonic()
                socks = await asyncio.gather(*(_send_unread(int(url.rsplit(":", 1)[1]), b) for b in bodies))
                del bodies
                at_engines = inflight = 0.0
                while time.monotonic() - t0 < a.timeout_s:
                    at_engines = sum(
                        [await _gauge(s, u, "vllm:num_requests_running") for u in engine_urls]
                        + [await _gauge(s, u, "vllm:num_requests_waiting") for u in engine_urls]
                    )
                    inflight = await _gauge(s, url, "cachehit_router_inflight_requests")
                    if at_engines >= admitted or (time.monotonic() - t0 > 20 and inflight < a.slots):
                        break  # every slot held at an engine, or requests failed (the router's log says why)
                    await asyncio.sleep(0.5)
                await asyncio.sleep(a.hold_s)
                _, peak_bytes = await sampler.stop()
                for sock in socks:
                    sock.close()
                for _ in range(600):  # until the router let go of every request
                    if await _gauge(s, url, "cachehit_router_inflight_requests") == 0:
                        break
                    await asyncio.sleep(0.2)
                after = await _settled_rss(sampler, a.settle_s)
                peak = peak_bytes / MIB
                per = (peak - idle) / max(1, admitted)  # the bodies' part: per body held
                results[kind] = {
                    "in_flight_at_router": inflight,
                    "bodies_held": admitted,
                    "at_engines": at_engines,
                    "rss_peak_mib": round(peak, 1),
                    "per_request_mib": round(per, 2),
                    "rss_after_mib": round(after, 1),
                }
                idle = min(idle, after)
    return {
        "config": vars(a),
        "rss_idle_mib": round(idle, 1),
        "bound_per_request_mib": round(memory_per_request_bound(cfg) / MIB, 2),
        "bound_total_mib": round(idle + memory_bound(cfg) / MIB, 1),
        **results,
    }


async def _hold_head(port: int, head_bytes: int, t0: float, wait_s: float) -> float | None:
    """Send a head of `head_bytes` without its end; seconds until the router closed the
    connection (None: still open after `wait_s`)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, b"GET /v1/models HTTP/1.1\r\nHost: router\r\n")
        line = b"X-Filler-%06d: " + b"a" * 7980 + b"\r\n"
        sent, i = 0, 0
        while sent < head_bytes:
            piece = line % i
            await loop.sock_sendall(sock, piece)
            sent, i = sent + len(piece), i + 1
        async with asyncio.timeout(wait_s):
            while await loop.sock_recv(sock, 65536):
                pass
    except TimeoutError:
        return None
    except OSError:  # reset: closed by the router (431 while it was still sending)
        pass
    finally:
        sock.close()
    return time.monotonic() - t0


async def run_heads(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    a.slots = 1
    with ProcessSet(out / "logs") as ps:
        url, engine_urls = _start_cluster(ps, a, out, {"header_timeout_s": a.header_timeout_s})
        sampler = RSSSampler(await _ready(ps, url, engine_urls))
        port = int(url.rsplit(":", 1)[1])
        idle = await _settled_rss(sampler, a.settle_s)
        sampler.start()
        t0 = time.monotonic()
        wait_s = 3 * a.header_timeout_s + 10
        ended = await asyncio.gather(*(_hold_head(port, a.head_bytes, t0, wait_s) for _ in range(a.connections)))
        _, peak_bytes = await sampler.stop()
        after = await _settled_rss(sampler, a.settle_s)  # the clients have closed their sockets
    closed = [t for t in ended if t is not None] or [float("nan")]
    return {
        "config": vars(a),
        "rss_idle_mib": round(idle, 1),
        "rss_peak_mib": round(peak_bytes / MIB, 1),
        "still_open_after_s": {wait_s: len(ended) - len([t for t in ended if t is not None])},
        "closed_after_s_max": round(max(closed), 2),
        "closed_after_s_median": round(sorted(closed)[len(closed) // 2], 2),
        "rss_after_mib": round(after, 1),
        "after_over_idle": round(after / idle, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench limits", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("bodies", "heads"), default="bodies")
    p.add_argument("--slots", type=int, default=64, help="server.max_concurrent_requests (bodies)")
    p.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes)
    p.add_argument("--max-body-bytes-in-flight", type=int, default=ServerConfig.max_body_bytes_in_flight)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--speed", type=float, default=0.001, help="simulator speed (slow: requests stay in flight)")
    p.add_argument("--hold-s", type=float, default=5.0, help="how long every slot is held once all are in flight")
    p.add_argument("--timeout-s", type=float, default=300.0, help="longest wait for every request to be in flight")
    p.add_argument("--connections", type=int, default=300, help="clients sending unfinished heads (heads)")
    p.add_argument("--head-bytes", type=int, default=1_000_000, help="head bytes each client sends (heads)")
    p.add_argument("--header-timeout-s", type=float, default=ServerConfig.header_timeout_s)
    p.add_argument("--settle-s", type=float, default=4.0, help="wait before an idle RSS reading")
    p.add_argument("--out", help="output directory (default bench/out/limits-<mode>-<UTC time>)")
    a = p.parse_args(argv)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(a.out or REPO / "bench" / "out" / f"limits-{a.mode}-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    res = asyncio.run(run_bodies(a, out) if a.mode == "bodies" else run_heads(a, out))
    (out / "limits.json").write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "config"}, indent=2))
    print(f"results in {out}/limits.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
