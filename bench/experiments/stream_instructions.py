"""`python -m bench stream-instructions`: user-space instructions per streamed request, counted.

CPU time on a shared machine drifts by tens of percent between runs of the same code (other
tenants, clock speed, caches), so a change worth a few percent of a request cannot be seen in
`bench overhead --streams`. Here each target (the same as there: the aiohttp pass-through,
modes of ours, and with `--base-checkout DIR` each router mode started from DIR as
`NAME@base`) runs under valgrind's callgrind: after a warm-up its counters are zeroed,
`--requests` streamed requests are sent one after another on one connection, and the
instructions it executed in between are read. Runs of one checkout repeat within ~1%.

What it counts is the process's own instructions (Python, aiohttp, orjson, libc), not the
kernel's work on its behalf (socket reads, writes, epoll) nor stalls on memory: a proxy's
whole CPU is more, so compare targets of one kind (a router checkout with another, a mode
with a mode), and read CPU time from `bench overhead --streams` for the floor's ratio.
Under callgrind a process runs ~50x slower: a few hundred requests a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.harness.procs import PY, Proc, ProcessSet, free_ports, wait_http
from bench.harness.stats import rnd
from bench.harness.stream_targets import BASE, ENV, ROUTER_MODES, SHAPES, client_load, start_target
from bench.reports.render import console, markdown_table, table

WARMUP_REQUESTS = 30
_SUMMARY = re.compile(rb"^(?:summary|totals): (\d+)", re.M)


def callgrind(out: Path) -> list[str]:
    """The command prefix: callgrind writing to `out` (dumps as `out.1`, `out.2`, ...)."""
    exe = shutil.which("valgrind")
    if exe is None:
        raise SystemExit("stream-instructions needs valgrind (apt-get install valgrind)")
    return [exe, "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no", "--compress-strings=no"]


def counted(proc: Proc, out: Path, dumps: int, load: Any) -> int:
    """Instructions `proc` executes while `load()` runs: counters zeroed before, dumped after."""
    control = shutil.which("callgrind_control") or "callgrind_control"
    subprocess.run([control, "--zero", str(proc.pid)], check=True, capture_output=True, timeout=120)
    load()
    subprocess.run([control, "--dump", str(proc.pid)], check=True, capture_output=True, timeout=120)
    dump = Path(f"{out}.{dumps}")
    m = _SUMMARY.search(dump.read_bytes())
    if m is None:
        raise SystemExit(f"no instruction count in {dump}")
    return int(m.group(1))


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in a.targets.split(",") if n]
    base = Path(a.base_checkout).resolve() if a.base_checkout else None
    if base is not None:
        names += [n + BASE for n in names if n in ROUTER_MODES]
    lengths = [int(n) for n in a.streams.split(",") if n]
    shapes = [s for s in a.stream_shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--stream-shapes: unknown {', '.join(unknown)} (one of {', '.join(SHAPES)})")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmpd, ProcessSet(out / "logs") as procs:
        bports = free_ports(4)
        cmd = [PY, "-m", "bench.harness.instant_backend", *(x for p in bports for x in ("--port", str(p)))]
        backend = procs.start("instant_backend", cmd, ENV)
        burls = [f"http://127.0.0.1:{p}" for p in bports]
        for u in burls:
            asyncio.run(wait_http(u + "/health", backend, 30))
        for name in names:  # one at a time: each under valgrind takes a core
            cg = Path(tmpd) / f"{name}.cg"
            port, proc = asyncio.run(
                start_target(procs, name, burls, None, Path(tmpd), base_checkout=base, wrap=callgrind(cg))
            )
            dumps = 0
            for shape in shapes:
                for n in lengths:
                    console.print(f"instructions: {shape} x {n} chunks: {name}")
                    asyncio.run(client_load(port, n, SHAPES[shape], WARMUP_REQUESTS, 1))
                    dumps += 1
                    load = functools.partial(client_load, port, n, SHAPES[shape], a.requests, 1)
                    total = counted(proc, cg, dumps, lambda load=load: asyncio.run(load()))
                    rows.append({"target": name, "shape": shape, "chunks": n, "per_request": total / a.requests})
            procs.stop(proc)
    for r in rows:
        key = (r["shape"], r["chunks"])
        floor = next(
            (o["per_request"] for o in rows if o["target"] == "passthrough" and (o["shape"], o["chunks"]) == key), None
        )
        twin = next(
            (o["per_request"] for o in rows if o["target"] == r["target"] + BASE and (o["shape"], o["chunks"]) == key),
            None,
        )
        r["x_passthrough"] = rnd(r["per_request"] / floor, 2) if floor else None
        r["x_base"] = rnd(r["per_request"] / twin, 3) if twin else None
        r["per_chunk"] = rnd(r["per_request"] / r["chunks"], 0)
        r["per_request"] = rnd(r["per_request"], 0)
    cols = [
        ("shape", "shape"),
        ("chunks", "chunks"),
        ("target", "target"),
        ("per_request", "instructions/request"),
        ("per_chunk", "instructions/chunk"),
        ("x_passthrough", "x pass-through"),
        ("x_base", "x @base"),
    ]
    nd = {"per_request": 0, "per_chunk": 0, "x_passthrough": 2, "x_base": 3, "chunks": 0}
    console.print(table(f"User-space instructions per streamed request ({a.requests} requests each)", cols, rows, nd))
    (out / "stream_instructions.md").write_text(markdown_table(cols, rows, nd) + "\n")
    (out / "stream_instructions.json").write_text(json.dumps({"requests": a.requests, "rows": rows}, indent=2))
    return 0
