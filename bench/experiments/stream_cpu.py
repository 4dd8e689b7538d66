"""`python -m bench overhead --streams 16,256,1024`: proxy CPU per streamed request and per chunk.

Every target (the aiohttp pass-through floor, each mode of ours, vllm-router) sits in front of
the same instant backend (`bench.harness.instant_backend`) and is started once; then for
each stream shape, every target in turn (interleaved) receives the same requests:

- `instant`: the whole stream written at once (the chunks arrive together: what a proxy
  can coalesce), requests one after another on one connection;
- `paced`: one chunk a write every millisecond (an engine's decode steps, much faster than
  a real one so a run stays short), `--stream-concurrency` streams at once;
- `burst`: 8 chunks a write every 8 ms (an engine that batches its output).

The figure is the target process's CPU time (user + system, psutil, children included)
over the requests, per request and per chunk; not wall time, so contention from other
processes on the machine does not count. `--profile SHAPE:CHUNKS` (default `paced:256`) also
profiles the round-robin router (py-spy if installed, else cProfile) on such streams: where a
chunk's time goes.

A change worth a few percent hides in a shared machine's drift between runs, so an A/B runs
in one: `--base-checkout DIR` starts each router target twice, from this checkout and from
DIR (`NAME@base`), and `--stream-rounds N` measures every target N times in alternation. The
table gives each figure's median, each round's ratio to the pass-through, and each round's
ratio of a target to its `@base` twin measured beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.harness.procs import PY, ProcessSet, RSSSampler, free_ports, pinned, split_cores, wait_http
from bench.harness.stats import rnd
from bench.harness.stream_targets import (
    BASE,
    DEFAULT_TARGETS,
    ENV,
    ROUTER_MODES,
    SHAPES,
    client_load,
    start_target,
    vllm_router_exe,
)
from bench.reports.render import console, markdown_table, table


def measure(pid: int, port: int, chunks: int, shape: str, a: argparse.Namespace) -> dict[str, Any]:
    requests = max(4, a.stream_chunks // chunks)
    concurrency = 1 if shape == "instant" else a.stream_concurrency
    asyncio.run(client_load(port, chunks, SHAPES[shape], min(8, requests), concurrency))  # warm-up
    sampler = RSSSampler(pid)
    errors = asyncio.run(client_load(port, chunks, SHAPES[shape], requests, concurrency))
    cpu = sampler.cpu_s() - sampler.cpu0
    return {
        "cpu_us_per_req": cpu / requests * 1e6,
        "cpu_us_per_chunk": cpu / (requests * chunks) * 1e6,
        "errors": errors,
    }


def summarise(mine: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's rounds at one (shape, length): median CPU, and per round its ratio to
    the pass-through and to its `@base` twin (each measured in the same round)."""

    def same_round(r: dict[str, Any], target: str) -> float | None:
        for o in runs:
            if (o["round"], o["shape"], o["chunks"], o["target"]) == (r["round"], r["shape"], r["chunks"], target):
                return float(o["cpu_us_per_req"])
        return None

    first = mine[0]
    floors = [same_round(r, "passthrough") for r in mine]
    x_pass = [r["cpu_us_per_req"] / f for r, f in zip(mine, floors, strict=True) if f]
    twin = first["target"] + BASE
    bases = [same_round(r, twin) for r in mine]
    x_base = [r["cpu_us_per_req"] / b for r, b in zip(mine, bases, strict=True) if b]
    return {
        "target": first["target"],
        "shape": first["shape"],
        "chunks": first["chunks"],
        "cpu_us_per_req": rnd(statistics.median(r["cpu_us_per_req"] for r in mine), 1),
        "cpu_us_per_chunk": rnd(statistics.median(r["cpu_us_per_chunk"] for r in mine), 2),
        "x_passthrough": rnd(statistics.median(x_pass), 2) if x_pass else None,
        "x_passthrough_each": ", ".join(f"{x:.2f}" for x in x_pass),
        "x_base_each": ", ".join(f"{x:.2f}" for x in x_base),
        "errors": sum(r["errors"] for r in mine),
    }


def profile_summary(path: Path, chunks: int, top: int = 18) -> list[dict[str, Any]]:
    """The functions with the most own time, in microseconds per streamed chunk."""
    st = pstats.Stats(str(path))
    stats: dict[Any, Any] = st.stats  # type: ignore[attr-defined]  # pstats keeps it undeclared
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({fn})", "calls": nc, "tottime": tt, "cumtime": ct})
    rows.sort(key=lambda r: -r["tottime"])
    return [
        {**r, "us_per_chunk": r["tottime"] / chunks * 1e6, "cum_us_per_chunk": r["cumtime"] / chunks * 1e6}
        for r in rows[:top]
    ]


def py_spy() -> str | None:
    """py-spy (`pip install py-spy`), from $PY_SPY, the venv or PATH."""
    return os.environ.get("PY_SPY") or shutil.which("py-spy", path=str(Path(PY).parent)) or shutil.which("py-spy")


_FRAME = re.compile(r"^(.*?) \((?:.*/(?:site-packages|python3\.\d+)/)?(.*?):\d+\)$")


def spy_summary(raw: Path, cpu_us_per_chunk: float, top: int = 18) -> list[dict[str, Any]]:
    """py-spy's collapsed stacks: each function's share of the samples on its own (self) and
    with what it calls, as microseconds of CPU per chunk."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        # per function: the file's path shortened, the line number dropped
        frames = [_FRAME.sub(r"\1 (\2)", f) for f in stack.split(";")]
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    return [
        {
            "function": f,
            "self_pct": 100 * n / total,
            "us_per_chunk": cpu_us_per_chunk * n / total,
            "cum_us_per_chunk": cpu_us_per_chunk * incl[f] / total,
        }
        for f, n in own.most_common(top)
    ]


def profile_stream(spec: str) -> tuple[str, int]:
    """`--profile`'s `SHAPE:CHUNKS` (e.g. `instant:16`) as (shape, chunks)."""
    shape, _, chunks = spec.partition(":")
    if shape not in SHAPES or not chunks.isdigit() or int(chunks) < 1:
        raise SystemExit(f"--profile {spec!r}: expected SHAPE:CHUNKS, SHAPE one of {', '.join(SHAPES)}")
    return shape, int(chunks)


def run_profile(
    procs: ProcessSet, urls: list[str], cores: list[int] | None, work: Path, a: argparse.Namespace
) -> list[dict[str, Any]]:
    """Where a chunk's CPU goes in the round-robin router, on streams of `a.profile`'s shape
    and length: py-spy (sampling: what the process spends, C code in the caller's line) when
    installed, else cProfile on the CPU clock (whose own cost per call inflates small,
    frequent functions)."""
    shape, chunks = profile_stream(a.profile)
    spy = py_spy()
    out = work / ("router.spy" if spy else "router.prof")
    port, proc = asyncio.run(start_target(procs, "router_round_robin", urls, cores, work, None if spy else out))
    requests = max(8, a.stream_chunks // chunks)
    concurrency = 1 if shape == "instant" else a.stream_concurrency
    recorder = None
    if spy:
        cmd = [spy, "record", "-p", str(proc.pid), "-r", "400", "-f", "raw", "-o", str(out), "--nonblocking"]
        recorder = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached before the load starts
    sampler = RSSSampler(proc.pid)
    asyncio.run(client_load(port, chunks, SHAPES[shape], requests, concurrency))
    cpu_us_per_chunk = (sampler.cpu_s() - sampler.cpu0) / (chunks * requests) * 1e6
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(60)
        procs.stop(proc)
        return spy_summary(out, cpu_us_per_chunk)
    os.killpg(proc.pid, signal.SIGTERM)  # cProfile writes its file when the router exits
    proc.popen.wait(60)
    procs.stop(proc)
    return profile_summary(out, chunks * requests)


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    proxy_cores, other_cores = split_cores(a.no_pin)
    own = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory() as tmpd, ProcessSet(out / "logs") as procs:
        bports = free_ports(4)
        cmd = [PY, "-m", "bench.harness.instant_backend", *(x for p in bports for x in ("--port", str(p)))]
        backend = procs.start("instant_backend", pinned(cmd, other_cores), ENV)
        burls = [f"http://127.0.0.1:{p}" for p in bports]
        for u in burls:
            asyncio.run(wait_http(u + "/health", backend, 30))
        if other_cores is not None:
            os.sched_setaffinity(0, other_cores)
        try:
            result = run(a, procs, burls, proxy_cores, Path(tmpd))
        finally:
            os.sched_setaffinity(0, own)
    (out / "stream_cpu.json").write_text(json.dumps(result, indent=2))
    return 0


def run(
    a: argparse.Namespace, procs: ProcessSet, burls: list[str], proxy_cores: list[int] | None, work: Path
) -> dict[str, Any]:
    if a.profile:
        profile_stream(a.profile)  # a bad spec fails now, not after the measurements
    names = [n for n in (a.targets.split(",") if a.targets else DEFAULT_TARGETS) if n]
    if "vllm_router_rr" in names and vllm_router_exe() is None:
        names.remove("vllm_router_rr")
    lengths = [int(n) for n in a.streams.split(",") if n]
    shapes = [s for s in a.stream_shapes.split(",") if s]
    base = Path(a.base_checkout).resolve() if a.base_checkout else None
    if base is not None:
        names += [n + BASE for n in names if n in ROUTER_MODES]
    started = {n: asyncio.run(start_target(procs, n, burls, proxy_cores, work, base_checkout=base)) for n in names}
    runs: list[dict[str, Any]] = []
    for k in range(a.stream_rounds):
        order = names[k % len(names) :] + names[: k % len(names)]  # no target always first
        for shape in shapes:
            for n in lengths:
                for name in order:
                    port, proc = started[name]
                    console.print(f"streams: round {k + 1}, {shape} x {n} chunks: {name}")
                    m = measure(proc.pid, port, n, shape, a)
                    runs.append({"round": k, "target": name, "shape": shape, "chunks": n, **m})
    for _port, proc in started.values():
        procs.stop(proc)
    rows = [
        summarise([r for r in runs if (r["shape"], r["chunks"], r["target"]) == (shape, n, name)], runs)
        for shape in shapes
        for n in lengths
        for name in names
    ]
    result: dict[str, Any] = {"streams": rows}
    cols = [
        ("shape", "shape"),
        ("chunks", "chunks"),
        ("target", "target"),
        ("cpu_us_per_req", "CPU us/request"),
        ("cpu_us_per_chunk", "CPU us/chunk"),
        ("x_passthrough", "x pass-through"),
        ("x_passthrough_each", "x pass-through, each round"),
        ("x_base_each", "x @base, each round"),
        ("errors", "errors"),
    ]
    nd = {"x_passthrough": 2, "cpu_us_per_chunk": 2, "chunks": 0}
    console.print(table("Proxy CPU per streamed request (process CPU time, not wall)", cols, rows, nd))
    md = markdown_table(cols, rows, nd) + "\n"
    if a.profile:
        prof = run_profile(procs, burls, proxy_cores, work, a)
        result["profile"] = prof
        pcols = [
            ("function", "function"),
            ("calls", "calls"),
            ("self_pct", "self %"),
            ("us_per_chunk", "own us/chunk"),
            ("cum_us_per_chunk", "cumulative us/chunk"),
        ]
        pnd = {"us_per_chunk": 3, "cum_us_per_chunk": 3, "calls": 0, "self_pct": 1}
        how = "py-spy" if py_spy() else "cProfile"
        shape, chunks = profile_stream(a.profile)
        console.print(table(f"router_round_robin under {how}, {chunks}-chunk {shape} streams", pcols, prof, pnd))
        md += "\n" + markdown_table(pcols, prof, pnd) + "\n"
    (Path(a.out) / "stream_cpu.md").write_text(md)
    return result
