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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.harness.cluster import RouterOptions, router_toml
from bench.harness.procs import PY, Proc, ProcessSet, RSSSampler, free_ports, pinned, split_cores, wait_http
from bench.harness.stats import rnd
from bench.reports.render import console, markdown_table, table

REPO = Path(__file__).resolve().parents[2]
# The router is started as `python -m router` with this checkout first on the path (the
# installed `router` script may import another copy).
ENV = {"PYTHONPATH": str(REPO)}

# target name -> (strategy, engines in the race, extra [routing] keys)
ROUTER_MODES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "router_round_robin": ("round_robin", 1, {}),
    "router_least_loaded": ("least_loaded", 1, {}),
    "router_prefix_tree": ("prefix_tree", 1, {}),
    "router_kv_events": ("kv_events", 1, {}),
    "router_probe_k1": ("probe", 1, {"race": "always"}),
    "router_probe_k4": ("probe", 4, {"race": "always"}),
}
DEFAULT_TARGETS = ["passthrough", *ROUTER_MODES, "vllm_router_rr"]
SHAPES = {"instant": None, "paced": "pace_ms=1;burst=1", "burst": "pace_ms=8;burst=8"}


def vllm_router_exe() -> str | None:
    return shutil.which("vllm-router", path=str(Path(PY).parent)) or shutil.which("vllm-router")


def router_cmd(cfg: Path, profile_out: Path | None = None) -> list[str]:
    prof = ["-m", "bench.harness.profiled", str(profile_out)] if profile_out is not None else []
    return [PY, *prof, "-m", "router", "--config", str(cfg), "--no-engines"]


BASE = "@base"  # a target's twin started from --base-checkout


async def start_target(
    procs: ProcessSet,
    name: str,
    urls: list[str],
    cores: list[int] | None,
    work: Path,
    profile: Path | None = None,
    base_checkout: Path | None = None,
    wrap: Sequence[str] = (),
) -> tuple[int, Proc]:
    """Start target `name` on a free port (`wrap`: a command it runs under, e.g. valgrind)."""
    port = free_ports(1)[0]
    mode, twin, rest = name.partition(BASE)
    if twin:
        if base_checkout is None or mode not in ROUTER_MODES or rest:
            raise SystemExit(f"stream target {name!r}: only a router mode has a twin, with --base-checkout")
        # PYTHONSAFEPATH: `python -m` would put the working directory (this checkout) first.
        cfg = work / f"{mode}-base.toml"
        cfg.write_text(router_toml(port, urls[: ROUTER_MODES[mode][1]], [], _router_options(mode)))
        cmd = pinned([*wrap, *router_cmd(cfg)], cores)
        proc = procs.start(name, cmd, {"PYTHONSAFEPATH": "1"}, root=str(base_checkout))
        await wait_http(f"http://127.0.0.1:{port}/ready", proc, 60 * (1 + 9 * bool(wrap)))
        return port, proc
    if name == "passthrough":
        proc = procs.start(
            name,
            pinned([*wrap, PY, "-m", "bench.harness.passthrough", "--port", str(port), "--upstream", urls[0]], cores),
            ENV,
        )
        await wait_http(f"http://127.0.0.1:{port}/health", proc, 30 * (1 + 19 * bool(wrap)))
    elif name in ROUTER_MODES:
        cfg = work / f"{name}.toml"
        cfg.write_text(router_toml(port, urls[: ROUTER_MODES[name][1]], [], _router_options(name)))
        proc = procs.start(name, pinned([*wrap, *router_cmd(cfg, profile)], cores), ENV)
        await wait_http(f"http://127.0.0.1:{port}/ready", proc, 60 * (1 + 9 * bool(wrap)))
    elif name == "vllm_router_rr":
        exe = vllm_router_exe()
        if exe is None:
            raise SystemExit("vllm_router_rr needs vllm-router, which is not installed")
        prom = str(free_ports(1)[0])
        cmd = [*wrap, exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", urls[0]]
        cmd += ["--policy", "round_robin", "--prometheus-port", prom, "--log-level", "warning"]
        proc = procs.start(name, pinned(cmd, cores))
        await wait_http(f"http://127.0.0.1:{port}/health", proc, 60 * (1 + 9 * bool(wrap)))
    else:
        raise SystemExit(f"unknown stream target {name!r}")
    return port, proc


def _router_options(mode: str) -> RouterOptions:
    strategy, _k, extra = ROUTER_MODES[mode]
    return RouterOptions(
        strategy=strategy, log_level="info", threshold=0.5, probe_deadline_ms=1000.0, extra_routing=extra
    )


def request_bytes(port: int, chunks: int, pace: str | None) -> bytes:
    body: dict[str, Any] = {"model": "sim-model", "prompt": list(range(1, 33)), "max_tokens": chunks, "stream": True}
    if pace is not None:
        body["user"] = pace
    data = orjson.dumps(body)
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (port, len(data), data)
    )


async def read_answer(reader: asyncio.StreamReader) -> int:
    """One streamed answer; returns its `data:` events (0 for anything but a 200 ending in [DONE])."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_ok = head.startswith(b"HTTP/1.1 200")
    lower = head.lower()
    if b"content-length:" in lower:
        i = lower.index(b"content-length:") + 15
        body = await reader.readexactly(int(lower[i : lower.index(b"\r\n", i)]))
    else:  # chunked: the last frame is `0\r\n\r\n`
        parts = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            parts.append(await reader.readexactly(size + 2))
        body = b"".join(parts)
    if not status_ok or b"data: [DONE]" not in body:
        return 0
    return body.count(b"data: ")


async def client_load(port: int, chunks: int, pace: str | None, requests: int, concurrency: int) -> int:
    """Send `requests` streamed requests over `concurrency` keep-alive connections; errors."""
    req = request_bytes(port, chunks, pace)
    left = requests
    errors = 0

    async def one_connection() -> None:
        nonlocal left, errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        try:
            while left > 0:
                left -= 1
                writer.write(req)
                if await read_answer(reader) < chunks:
                    errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(one_connection() for _ in range(concurrency)))
    return errors


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
