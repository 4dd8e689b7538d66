"""`python -m bench reuse-port`: N router processes behind one port (`server.reuse_port`).

One router process uses one core; more cores are used by running N processes with the same
configuration on the same `host:port`, SO_REUSEPORT letting the kernel spread new
connections over them (docs/ARCHITECTURE.md, "Several router processes on one host"). For
each N in `--processes`, N round-robin routers are started in front of the same instant
backend (`bench.harness.instant_backend`) and `--connections` clients each open their own
keep-alive connection and send streamed requests (`--chunks` tokens, the whole answer at
once) for `--seconds`. Reported per N: requests/s, router CPU (all N processes, psutil) per
request, and each process's share of that CPU: how evenly the kernel spread the
connections. The clients and the backend share the machine with the routers, so requests/s
grow with N only while cores are free; CPU per request must not grow with N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.cluster import RouterOptions, router_toml
from bench.harness.procs import PY, ProcessSet, RSSSampler, free_ports, wait_http
from bench.harness.stats import rnd
from bench.harness.stream_targets import ENV, read_answer, request_bytes, router_cmd
from bench.reports.render import console, markdown_table, table


async def drive(port: int, chunks: int, connections: int, seconds: float) -> tuple[int, int]:
    """Streamed requests over `connections` connections (each its own, so the kernel places
    each on a process) until `seconds` pass; (answers complete, answers not)."""
    req = request_bytes(port, chunks, None)
    done = bad = 0
    end = time.monotonic() + seconds

    async def one_connection() -> None:
        nonlocal done, bad
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        try:
            while time.monotonic() < end:
                writer.write(req)
                if await read_answer(reader) >= chunks:
                    done += 1
                else:
                    bad += 1
        finally:
            writer.close()

    await asyncio.gather(*(one_connection() for _ in range(connections)))
    return done, bad


def measure(procs: ProcessSet, n: int, backend: str, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    port = free_ports(1)[0]
    opts = RouterOptions(strategy="round_robin", log_level="info", extra_server={"reuse_port": True})
    cfg = work / f"reuse_port_{n}.toml"
    cfg.write_text(router_toml(port, [backend], [], opts))
    started = [procs.start(f"router_{n}_{i}", router_cmd(cfg), ENV) for i in range(n)]
    try:
        for p in started:
            asyncio.run(wait_http(f"http://127.0.0.1:{port}/ready", p, 60))
        asyncio.run(drive(port, a.chunks, a.connections, min(1.0, a.seconds)))  # warm-up
        samplers = [RSSSampler(p.pid) for p in started]
        t0 = time.monotonic()
        done, bad = asyncio.run(drive(port, a.chunks, a.connections, a.seconds))
        wall = time.monotonic() - t0
        cpu = [s.cpu_s() - s.cpu0 for s in samplers]
    finally:
        for p in started:
            procs.stop(p)
    total = sum(cpu)
    return {
        "processes": n,
        "requests": done,
        "errors": bad,
        "rps": rnd(done / wall, 1),
        "cpu_us_per_req": rnd(total / max(done, 1) * 1e6, 1),
        "cpu_share": " / ".join(f"{c / total:.2f}" for c in cpu) if total > 0 else "-",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench reuse-port", description=__doc__)
    p.add_argument("--processes", default="1,2", help="router processes per measurement, comma-separated")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--chunks", type=int, default=16, help="tokens per streamed answer")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmpd, ProcessSet(out / "logs") as procs:
        bport = free_ports(1)[0]
        backend = procs.start("instant_backend", [PY, "-m", "bench.harness.instant_backend", "--port", str(bport)], ENV)
        asyncio.run(wait_http(f"http://127.0.0.1:{bport}/health", backend, 30))
        for n in (int(x) for x in a.processes.split(",") if x):
            console.print(f"reuse-port: {n} router process(es), {a.connections} connections, {a.seconds:g} s")
            rows.append(measure(procs, n, f"http://127.0.0.1:{bport}", Path(tmpd), a))
    cols = [
        ("processes", "router processes"),
        ("rps", "requests/s"),
        ("cpu_us_per_req", "router CPU us/request"),
        ("cpu_share", "each process's CPU share"),
        ("requests", "requests"),
        ("errors", "errors"),
    ]
    nd = {"processes": 0, "requests": 0, "errors": 0}
    console.print(
        table(f"N routers on one port, {a.chunks}-token streams, {a.connections} connections", cols, rows, nd)
    )
    (out / "reuse_port.json").write_text(json.dumps({"rows": rows, "args": vars(a)}, indent=2))
    (out / "reuse_port.md").write_text(markdown_table(cols, rows, nd) + "\n")
    return 1 if any(r["errors"] or not r["requests"] for r in rows) else 0
