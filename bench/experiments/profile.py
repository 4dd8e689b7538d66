"""`python -m bench profile`: where the router spends its CPU under load.

Starts the instant backend and our router (strategy of choice), drives it with wrk at
`--connections`, samples the router with py-spy (`pip install py-spy`) and prints the
functions with the most samples, by own time (the function on top of the stack) and by
inclusive time (anywhere on the stack). Writes profile.json and the raw collapsed stacks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from bench.harness.cluster import RouterOptions, router_command, router_toml
from bench.harness.load_clients import SMALL, run_wrk
from bench.harness.procs import PY, Proc, ProcessSet, cpu_list, free_ports, pinned, wait_http
from bench.reports.render import console, markdown_table, table


def aggregate(raw_lines: list[str], top: int = 25) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw_lines:
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        frames = [f for f in stack.split(";") if f]
        if not frames:
            continue
        total += n
        own[_short(frames[-1])] += n
        for f in set(_short(x) for x in frames):
            incl[f] += n

    def rows(c: Counter[str]) -> list[dict[str, Any]]:
        return [
            {"function": f, "samples": n, "pct": 100.0 * n / total if total else 0.0} for f, n in c.most_common(top)
        ]

    return rows(own), rows(incl), total


def _short(frame: str) -> str:
    # py-spy raw frames look like "func (path/to/file.py:123)"; keep func and file:line.
    name, _, loc = frame.partition(" (")
    loc = loc.rstrip(")").rsplit(":", 1)[0]  # per function, not per line
    repo = str(Path(__file__).resolve().parents[2]) + "/"
    for marker in ("site-packages/", repo, "lib/python3"):
        if marker in loc:
            loc = loc.split(marker, 1)[1]
    return f"{name} ({loc})" if loc else name


def main(a: argparse.Namespace) -> int:
    spy = shutil.which("py-spy", path=str(Path(PY).parent)) or shutil.which("py-spy")
    if not spy:
        console.print("[red]py-spy is not installed (pip install py-spy)[/red]")
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = cpu_list()
    proxy_cores, other = ([cores[-1]], cores[:-1]) if len(cores) >= 2 else (None, None)
    with tempfile.TemporaryDirectory() as tmpd, ProcessSet(out / "logs") as procs:
        tmp = Path(tmpd)
        bports = free_ports(a.k)
        backend = procs.start(
            "instant_backend",
            pinned(
                [PY, "-m", "bench.harness.instant_backend", *(arg for p in bports for arg in ("--port", str(p)))], other
            ),
        )
        urls = [f"http://127.0.0.1:{p}" for p in bports]
        asyncio.run(_wait(urls, backend))
        port = free_ports(1)[0]
        cfg = tmp / "router.toml"
        cfg.write_text(
            router_toml(
                port, urls, [], RouterOptions(strategy=a.strategy, log_level=a.log_level, probe_deadline_ms=1000.0)
            )
        )
        router = procs.start("router", pinned([*router_command(), "--config", str(cfg), "--no-engines"], proxy_cores))
        asyncio.run(wait_http(f"http://127.0.0.1:{port}/ready", router, 60))
        body = {**SMALL, "stream": True} if a.stream else SMALL
        raw = out / f"profile_{a.strategy}{'_stream' if a.stream else ''}.raw"
        result: dict[str, Any] = {}

        def drive() -> None:
            result["wrk"] = run_wrk(port, body, a.connections, a.duration + 2, other, tmp)

        th = threading.Thread(target=drive)
        th.start()
        subprocess.run(
            [
                spy,
                "record",
                "-p",
                str(router.pid),
                "-d",
                str(int(a.duration)),
                "-r",
                "250",
                "--format",
                "raw",
                "-o",
                str(raw),
                "--nonblocking",
            ],
            capture_output=True,
            timeout=a.duration + 60,
        )
        th.join()
    lines = raw.read_text().splitlines() if raw.exists() else []
    own, incl, total = aggregate(lines, a.top)
    doc = {
        "strategy": a.strategy,
        "stream": a.stream,
        "connections": a.connections,
        "samples": total,
        "wrk_rps": result.get("wrk", {}).get("rps"),
        "own": own,
        "inclusive": incl,
        "loadavg": os.getloadavg(),
    }
    (out / f"profile_{a.strategy}{'_stream' if a.stream else ''}.json").write_text(json.dumps(doc, indent=2))
    cols = [("function", "function (file)"), ("samples", "samples"), ("pct", "% of samples")]
    console.print(
        table(
            f"Router own time: {a.strategy}, {'streaming' if a.stream else 'non-streaming'}, "
            f"wrk {a.connections} connections ({doc['wrk_rps']} req/s), {total} samples",
            cols,
            own,
        )
    )
    console.print(table("Router inclusive time", cols, incl))
    (out / f"profile_{a.strategy}{'_stream' if a.stream else ''}.md").write_text(
        "Own time\n\n" + markdown_table(cols, own) + "\n\nInclusive time\n\n" + markdown_table(cols, incl) + "\n"
    )
    return 0


async def _wait(urls: list[str], proc: Proc) -> None:
    await asyncio.gather(*(wait_http(u + "/health", proc, 30) for u in urls))
