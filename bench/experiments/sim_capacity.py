"""How much load one simulator process carries: `python -m bench sim-capacity`.

Starts one simulated engine in a child process (`python -m engine_launcher.sim`), drives it
from this process with closed-loop streaming clients (each client sends a streaming
completion, reads it to the end, sends the next), and for each concurrency level reports:

- whether the simulator kept up with its own timing model: `lag` = wall time of the engine
  loop's busy steps / their modelled time (1.00 = every step took exactly its modelled
  duration; above ~1.1 the process, not the model, sets the pace);
- the simulator process's CPU (from /proc, so the client's CPU is not counted): percent of
  one core, and CPU seconds per 1,000 requests;
- from those, how many engines at that load fit on one core.

Nothing is written to disk. The client shares the machine, so on a small or busy machine the
figures are a lower bound for the simulator itself. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

CLK_TCK = os.sysconf("SC_CLK_TCK")
# Kinds of failed requests across the run (reported at the end).
error_kinds: dict[str, int] = {}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    requests: int
    tokens: int
    sim_cpu_s: float
    model_busy_s: float
    wall_busy_s: float
    steps: int
    errors: int
    client_cpu_s: float

    @property
    def cpu_pct(self) -> float:
        return 100.0 * self.sim_cpu_s / self.wall_s

    @property
    def cpu_per_1k_requests(self) -> float:
        return 1000.0 * self.sim_cpu_s / max(self.requests, 1)

    @property
    def cpu_us_per_token(self) -> float:
        return 1e6 * self.sim_cpu_s / max(self.tokens, 1)

    @property
    def lag(self) -> float:
        return self.wall_busy_s / self.model_busy_s if self.model_busy_s else float("nan")


def start_simulator(args: argparse.Namespace) -> tuple[subprocess.Popen[str], int]:
    cmd = [
        sys.executable,
        "-m",
        "engine_launcher.sim",
        "--port",
        "0",
        "--speed",
        str(args.speed),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"simulator did not start: {line!r}")
    port = int(line.split("http://127.0.0.1:")[1].split()[0])
    return proc, port


async def state(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/_sim/state") as r:
        answer: dict[str, Any] = orjson.loads(await r.read())
        return answer


async def run_level(
    session: aiohttp.ClientSession, url: str, pid: int, concurrency: int, args: argparse.Namespace
) -> LevelResult:
    body = orjson.dumps({"prompt": [], "max_tokens": args.tokens, "ignore_eos": True, "stream": True})
    stop_at = 0.0
    counts = {"requests": 0, "chunks": 0, "errors": 0}

    async def client(i: int) -> None:
        n = 0
        while time.monotonic() < stop_at:
            # Distinct prompts per request: no prefix-cache shortcut for the engine.
            prompt = [2 + (i * 7919 + n * 104729 + k) % 700 for k in range(args.prompt_tokens)]
            n += 1
            payload = body.replace(b'"prompt":[]', b'"prompt":' + orjson.dumps(prompt))
            try:
                async with session.post(
                    url + "/v1/completions", data=payload, headers={"Content-Type": "application/json"}
                ) as r:
                    if r.status != 200:
                        counts["errors"] += 1
                        error_kinds[f"HTTP {r.status}"] = error_kinds.get(f"HTTP {r.status}", 0) + 1
                        await r.read()
                        continue
                    # Count events without parsing them: the client must stay cheap.
                    async for data in r.content.iter_any():
                        counts["chunks"] += data.count(b"data: {")
                counts["requests"] += 1
            except aiohttp.ClientError as e:
                counts["errors"] += 1
                error_kinds[type(e).__name__] = error_kinds.get(type(e).__name__, 0) + 1

    before = await state(session, url)
    cpu0 = cpu_seconds(pid)
    client0 = cpu_seconds(os.getpid())
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    wall = time.monotonic() - t0
    cpu = cpu_seconds(pid) - cpu0
    client_cpu = cpu_seconds(os.getpid()) - client0
    after = await state(session, url)
    return LevelResult(
        concurrency,
        wall,
        counts["requests"],
        after["generated"] - before["generated"],
        cpu,
        after["busy_model_seconds"] - before["busy_model_seconds"],
        after["busy_wall_seconds"] - before["busy_wall_seconds"],
        after["steps"] - before["steps"],
        counts["errors"],
        client_cpu,
    )


def report(console: Console, results: list[LevelResult], args: argparse.Namespace) -> None:
    t = Table(
        title=f"One simulator process (speed {args.speed:g}, {args.prompt_tokens}-token "
        f"prompts, {args.tokens} tokens per stream, {args.duration:g} s per level)"
    )
    for col in (
        "streams",
        "requests",
        "tokens/s",
        "steps/s",
        "lag",
        "sim CPU %",
        "CPU s / 1k req",
        "CPU us / token",
        "engines/core at this load",
        "client CPU %",
        "errors",
    ):
        t.add_column(col, justify="right")
    for r in results:
        engines = 100.0 / r.cpu_pct if r.cpu_pct > 0 else float("inf")
        t.add_row(
            str(r.concurrency),
            str(r.requests),
            f"{r.tokens / r.wall_s:,.0f}",
            f"{r.steps / r.wall_s:,.0f}",
            f"{r.lag:.2f}",
            f"{r.cpu_pct:.0f}",
            f"{r.cpu_per_1k_requests:.2f}",
            f"{r.cpu_us_per_token:.0f}",
            f"{engines:.1f}",
            f"{100.0 * r.client_cpu_s / r.wall_s:.0f}",
            str(r.errors),
        )
    console.print(t)
    kept = [r for r in results if r.lag <= 1.1 and r.errors == 0]
    if kept:
        best = max(kept, key=lambda r: r.concurrency)
        console.print(
            f"Sustained without lag: [bold]{best.concurrency}[/bold] concurrent streams "
            f"({best.tokens / best.wall_s:,.0f} tokens/s, {best.cpu_pct:.0f}% of a core)."
        )
    per_1k = [r.cpu_per_1k_requests for r in results if r.requests]
    if per_1k:
        console.print(
            f"CPU per 1,000 requests: {min(per_1k):.2f}-{max(per_1k):.2f} s "
            f"({args.prompt_tokens}-token prompts, {args.tokens} streamed tokens each)."
        )
    else:
        console.print("No request completed.")
    if error_kinds:
        console.print("Failed requests: " + ", ".join(f"{k} x{v}" for k, v in error_kinds.items()))
    console.print(
        "lag > 1 with low CPU means the process waited for a core (a busy machine or "
        "a client that cannot keep up), not that the simulator is slow."
    )


async def main_async(args: argparse.Namespace) -> None:
    console = Console(width=150)
    proc, port = start_simulator(args)
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            for level in args.levels:
                with console.status(f"{level} concurrent streams ..."):
                    results.append(await run_level(session, url, proc.pid, level, args))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    report(console, results, args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench sim-capacity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--levels",
        type=int,
        nargs="+",
        default=[50, 100, 200, 400, 800],
        help="concurrent streams to try (default: %(default)s)",
    )
    p.add_argument("--duration", type=float, default=8.0, help="seconds per level")
    p.add_argument("--speed", type=float, default=1.0, help="simulator time compression (1: real H100 timing)")
    p.add_argument("--tokens", type=int, default=100, help="generated tokens per stream")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=1024,
        help="engine running-set bound (vLLM default 256; higher here so every stream runs concurrently)",
    )
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.run(main_async(args))
    except ImportError:
        asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
