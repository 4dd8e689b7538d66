"""`python -m bench soak [--minutes M]`: a long steady load with periodic engine restarts.

Simulated engines run as processes (own process groups) behind `router --config` (also
a process). A closed loop of `--concurrency` streaming clients sends requests that share
a few long prefixes (so the probe race has cache hits to find); every `--restart-every`
seconds the next engine is killed (SIGKILL by default) and restarted on the same port.
Every request is classified: completed (all max_tokens, one id, usage right), error (a
clear OpenAI-style error) or lost (a hang, a stream cut without [DONE], a wrong count).

Reported over time (one sample per second, windows of `--window` seconds): completed and
failed requests, p50/p99 end-to-end latency and TTFT, router RSS and CPU, in-flight
requests. Output in `--out` (default `bench/out/soak-<UTC time>`): `summary.json`,
`timeline.csv` (per window), `samples.csv` (per second), `soak.png` (matplotlib) and a
rich summary table on the terminal.
With `--hang-up-fraction F` (default 0.2) that fraction of the requests are sent by
clients that hang up 0-300 ms after sending (during the probe race, the fallback or the
stream): they count as `hung_up`, and afterwards every gauge of the router (requests in
flight and queued, per backend, per tenant) and every engine's running and waiting
counts must return to 0.
Exit status 1 when a request was lost or a gauge did not return to 0.

Default run: 2 minutes, 4 engines, 32 streams. A longer run (docs/RELIABILITY.md):
    python -m bench soak --minutes 60 --concurrency 64 --restart-every 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson
import tomli_w

from bench.harness.procs import free_ports
from router.engine.sse import SSEDecoder

REPO = Path(__file__).resolve().parents[2]
MODEL = "sim-model"
PY = sys.executable


# --- processes ---------------------------------------------------------------------------


def _wait_http(url: str, timeout: float, proc: subprocess.Popen) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before {url} answered")
        with contextlib.suppress(Exception), urllib.request.urlopen(url, timeout=1.0) as r:
            if r.status == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


def _stop_group(proc: subprocess.Popen | None) -> None:
    """SIGTERM the process group, then SIGKILL; by group id only, never by name."""
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


@dataclass
class Engine:
    name: str
    port: int
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        deadline = time.monotonic() + 30
        while True:  # a killed engine's port may linger a moment
            self.proc = subprocess.Popen(
                [
                    PY,
                    "-m",
                    "engine_launcher.sim",
                    "--port",
                    str(self.port),
                    "--model",
                    MODEL,
                    "--log-level",
                    "warning",
                    *self.args,
                ],
                cwd=REPO,
                stdout=open(self.log, "ab"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                _wait_http(self.url + "/health", 30, self.proc)
                return
            except RuntimeError:
                _stop_group(self.proc)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def kill(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        _stop_group(self.proc)


def _router_toml(port: int, engines: list[Engine], args: argparse.Namespace) -> str:
    return tomli_w.dumps(
        {
            "server": {"port": port, "host": "127.0.0.1", "max_concurrent_requests": 1024, "max_queued_requests": 1024},
            "routing": {"max_retries": 3, "max_resumes": 4},
            "timeouts": {"connect_s": 2.0, "first_token_s": 30.0, "idle_s": float(args.idle_s), "total_s": 120.0},
            "health": {"scrape_interval_s": 0.5, "check_interval_s": 1.0, "failure_threshold": 3, "cooldown_s": 3.0},
            "backends": [{"name": e.name, "url": e.url, "role": "decode", "models": [MODEL]} for e in engines],
        }
    )


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


# --- load ---------------------------------------------------------------------------------


@dataclass
class Result:
    t: float  # completion time, seconds since start
    kind: str  # completed | error | lost | hung_up
    latency_s: float
    ttft_s: float | None
    detail: str = ""


@dataclass
class Sample:
    t: float
    rss_mib: float
    cpu_pct: float
    inflight: float
    completed: int
    errors: int
    lost: int


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    restarts: list[tuple[float, str]] = field(default_factory=list)
    final_gauges: dict[str, float] = field(default_factory=dict)


PREFIXES = [" ".join(f"p{g}w{i}" for i in range(300)) for g in range(6)]


async def one_request(
    s: aiohttp.ClientSession, url: str, rng: random.Random, max_tokens: int, t0: float, bound_s: float
) -> Result:
    prompt = rng.choice(PREFIXES) + f" question {rng.randrange(10**9)}"
    start = time.monotonic()
    ttft = None
    body = orjson.dumps(
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    events: list = []
    try:
        async with asyncio.timeout(bound_s):
            async with s.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                if r.status != 200:
                    raw = await r.read()
                    try:
                        msg = orjson.loads(raw)["error"]["message"]
                    except Exception:
                        return Result(
                            time.monotonic() - t0,
                            "lost",
                            time.monotonic() - start,
                            None,
                            f"HTTP {r.status} without an error body",
                        )
                    return Result(
                        time.monotonic() - t0, "error", time.monotonic() - start, None, f"HTTP {r.status}: {msg}"
                    )
                decoder = SSEDecoder()
                async for data in r.content.iter_any():
                    if ttft is None:
                        ttft = time.monotonic() - start
                    for p in decoder.feed(data):
                        events.append("[DONE]" if p == b"[DONE]" else orjson.loads(p))
    except TimeoutError:
        return Result(time.monotonic() - t0, "lost", time.monotonic() - start, ttft, f"no end within {bound_s} s")
    except aiohttp.ClientError as e:
        return Result(time.monotonic() - t0, "lost", time.monotonic() - start, ttft, f"connection: {e!r}")
    latency = time.monotonic() - start
    now = time.monotonic() - t0
    if not events or events[-1] != "[DONE]":
        return Result(now, "lost", latency, ttft, "stream ended without [DONE]")
    chunks = events[:-1]
    errs = [c for c in chunks if "error" in c]
    if errs:
        return Result(now, "error", latency, ttft, f"stream error: {errs[0]['error'].get('message')}")
    usage = chunks[-1].get("usage") if chunks else None
    if len({c["id"] for c in chunks}) != 1 or not usage or usage.get("completion_tokens") != max_tokens:
        return Result(now, "lost", latency, ttft, f"malformed answer (usage {usage})")
    return Result(now, "completed", latency, ttft)


async def hang_up_early(port: int, rng: random.Random, max_tokens: int, t0: float) -> Result:
    """Send a streamed request on a raw connection, read for 0-300 ms, then close it."""
    start = time.monotonic()
    body = orjson.dumps(
        {
            "model": MODEL,
            "prompt": rng.choice(PREFIXES) + f" gone {rng.randrange(10**9)}",
            "max_tokens": max_tokens,
            "stream": True,
        }
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(rng.uniform(0.0, 0.3)):
                while await reader.read(65536):
                    pass
    finally:
        writer.transport.abort()
    return Result(time.monotonic() - t0, "hung_up", time.monotonic() - start, None)


GAUGES = (
    "cachehit_router_inflight_requests",
    "cachehit_router_backend_inflight",
    "cachehit_router_queued_requests",
    "cachehit_router_tenant_inflight",
    "cachehit_router_tenant_queued",
)
ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


async def metrics_value(s: aiohttp.ClientSession, url: str, name: str) -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


async def soak(args: argparse.Namespace, out: Path) -> tuple[dict, list[Sample]]:
    *engine_ports, port = free_ports(args.engines + 1)
    engines = [Engine(f"d{i}", p, ["--speed", str(args.speed)], out / f"d{i}.log") for i, p in enumerate(engine_ports)]
    router_proc: subprocess.Popen | None = None
    run = Run()
    try:
        for e in engines:
            e.start()
        (out / "router.toml").write_text(_router_toml(port, engines, args))
        router_proc = subprocess.Popen(
            [PY, "-m", "router.cli", "--config", str(out / "router.toml"), "--no-engines"],
            cwd=REPO,
            stdout=open(out / "router.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/health", 60, router_proc)
        pid = router_proc.pid
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        stop = asyncio.Event()
        rng = random.Random(args.seed)

        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        ) as s:

            async def worker(i: int) -> None:
                wrng = random.Random(rng.randrange(2**32) + i)
                while not stop.is_set():
                    if wrng.random() < args.hang_up_fraction:
                        run.results.append(await hang_up_early(port, wrng, args.max_tokens, t0))
                    else:
                        run.results.append(await one_request(s, url, wrng, args.max_tokens, t0, args.request_bound_s))

            async def restarter() -> None:
                k = 0
                while True:
                    await asyncio.sleep(args.restart_every)
                    if stop.is_set():
                        return
                    e = engines[k % len(engines)]
                    k += 1
                    run.restarts.append((time.monotonic() - t0, e.name))
                    print(
                        f"[{time.monotonic() - t0:7.1f}s] killing {e.name} ({args.kill_signal}), "
                        "restarting on the same port",
                        flush=True,
                    )
                    await asyncio.to_thread(e.kill, getattr(signal, args.kill_signal))
                    await asyncio.sleep(args.down_s)
                    await asyncio.to_thread(e.start)

            async def sampler() -> None:
                last_cpu, last_t = _cpu_seconds(pid), time.monotonic()
                seen = 0
                inflight = 0.0
                while not stop.is_set():
                    await asyncio.sleep(1.0)
                    now = time.monotonic()
                    cpu = _cpu_seconds(pid)
                    new = run.results[seen:]
                    seen = len(run.results)
                    with contextlib.suppress(Exception):
                        inflight = await metrics_value(s, url, "cachehit_router_inflight_requests")
                    run.samples.append(
                        Sample(
                            now - t0,
                            _rss(pid) / 2**20,
                            100 * (cpu - last_cpu) / (now - last_t),
                            inflight,
                            sum(r.kind == "completed" for r in new),
                            sum(r.kind == "error" for r in new),
                            sum(r.kind == "lost" for r in new),
                        )
                    )
                    last_cpu, last_t = cpu, now
                    if len(run.samples) % 10 == 0:
                        tot = len(run.results)
                        print(
                            f"[{now - t0:7.1f}s] {tot} requests, {sum(r.kind == 'error' for r in run.results)} "
                            f"errors, {sum(r.kind == 'lost' for r in run.results)} lost, "
                            f"router RSS {run.samples[-1].rss_mib:.1f} MiB",
                            flush=True,
                        )

            workers = [asyncio.create_task(worker(i)) for i in range(args.concurrency)]
            aux = [asyncio.create_task(restarter()), asyncio.create_task(sampler())]
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            stop.set()
            await asyncio.gather(*workers)
            for t in aux:
                t.cancel()
            await asyncio.gather(*aux, return_exceptions=True)
            # Drained: the router and the engines hold nothing once the clients are done
            # (hung-up requests included: every one of them was aborted).
            drained = False
            gauges: dict[str, float] = {}
            for _ in range(300):
                gauges = {n: await metrics_value(s, url, n) for n in GAUGES}
                for e in engines:
                    for n in ENGINE_GAUGES:
                        with contextlib.suppress(Exception):
                            gauges[f"{e.name} {n}"] = await metrics_value(s, e.url, n)
                if not any(gauges.values()):
                    drained = True
                    break
                await asyncio.sleep(0.1)
            run.final_gauges = gauges
        final_rss = _rss(pid) / 2**20
    finally:
        _stop_group(router_proc)
        for e in engines:
            _stop_group(e.proc)
    return summarize(run, args, drained, final_rss), run.samples


# --- report ---------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def windows(run: Run, width: float) -> list[dict]:
    if not run.samples:
        return []
    horizon = run.samples[-1].t
    out = []
    t = 0.0
    while t + width <= horizon + 1e-9:  # whole windows only
        rs = [r for r in run.results if t <= r.t < t + width]
        ok = [r.latency_s for r in rs if r.kind == "completed"]
        ss = [s for s in run.samples if t <= s.t < t + width]
        out.append(
            {
                "t": t + width / 2,
                "completed": len(ok),
                "errors": sum(r.kind == "error" for r in rs),
                "lost": sum(r.kind == "lost" for r in rs),
                "p50_s": _pct(ok, 0.5),
                "p99_s": _pct(ok, 0.99),
                "rss_mib": max((s.rss_mib for s in ss), default=None),
            }
        )
        t += width
    return out


def summarize(run: Run, args: argparse.Namespace, drained: bool, final_rss: float) -> dict:
    ok = [r for r in run.results if r.kind == "completed"]
    lat = [r.latency_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    errors: dict[str, int] = {}
    for r in run.results:
        if r.kind not in ("completed", "hung_up"):
            key = f"{r.kind}: {r.detail[:100]}"
            errors[key] = errors.get(key, 0) + 1
    rss = [s.rss_mib for s in run.samples]
    n_first = max(1, len(rss) // 10)
    return {
        "config": vars(args),
        "duration_s": run.samples[-1].t if run.samples else 0.0,
        "requests": len(run.results),
        "completed": len(ok),
        "errors": sum(r.kind == "error" for r in run.results),
        "lost": sum(r.kind == "lost" for r in run.results),
        "hung_up": sum(r.kind == "hung_up" for r in run.results),
        "error_rate": (
            sum(r.kind in ("error", "lost") for r in run.results) / len(run.results) if run.results else 0.0
        ),
        "throughput_rps": len(ok) / run.samples[-1].t if run.samples else 0.0,
        "latency_p50_s": _pct(lat, 0.5),
        "latency_p99_s": _pct(lat, 0.99),
        "latency_max_s": max(lat) if lat else None,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "rss_start_mib": statistics.mean(rss[:n_first]) if rss else None,
        "rss_end_mib": statistics.mean(rss[-n_first:]) if rss else None,
        "rss_max_mib": max(rss) if rss else None,
        "rss_final_mib": final_rss,
        "router_cpu_mean_pct": statistics.mean(s.cpu_pct for s in run.samples) if run.samples else None,
        "restarts": [{"t": t, "engine": n} for t, n in run.restarts],
        "drained": drained,
        "final_gauges": run.final_gauges,
        "failures": dict(sorted(errors.items(), key=lambda kv: -kv[1])),
        "windows": windows(run, args.window),
    }


def plot(run_summary: dict, samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = run_summary["windows"]
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    ts = [x["t"] for x in w]
    axes[0].bar(
        ts,
        [x["completed"] for x in w],
        width=run_summary["config"]["window"] * 0.8,
        label="completed",
        color="tab:green",
    )
    axes[0].bar(
        ts,
        [x["errors"] + x["lost"] for x in w],
        width=run_summary["config"]["window"] * 0.8,
        label="errors + lost",
        color="tab:red",
    )
    axes[0].set_ylabel(f"requests / {run_summary['config']['window']:g} s")
    axes[0].legend(loc="upper right")
    axes[1].plot(ts, [x["p50_s"] for x in w], marker=".", label="p50")
    axes[1].plot(ts, [x["p99_s"] for x in w], marker=".", label="p99")
    axes[1].set_ylabel("end-to-end latency (s)")
    axes[1].legend(loc="upper right")
    axes[2].plot([s.t for s in samples], [s.rss_mib for s in samples], color="tab:purple", label="router RSS")
    axes[2].set_ylabel("router RSS (MiB)")
    axes[2].set_xlabel("time (s)")
    ax2 = axes[2].twinx()
    ax2.plot([s.t for s in samples], [s.cpu_pct for s in samples], color="tab:gray", alpha=0.5, label="router CPU %")
    ax2.set_ylabel("router CPU (%)")
    for ax in axes:
        for r in run_summary["restarts"]:
            ax.axvline(r["t"], color="k", alpha=0.25, linestyle="--")
    axes[0].set_title(
        f"soak: {run_summary['requests']} requests, {run_summary['errors']} errors, "
        f"{run_summary['lost']} lost; dashed lines: engine restarts"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(summary: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(v, unit="", nd=3):
        return "-" if v is None else (f"{v:.{nd}f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    t = Table(
        title=f"soak ({summary['duration_s'] / 60:.1f} min, {summary['config']['engines']} engines, "
        f"{summary['config']['concurrency']} streams, {len(summary['restarts'])} restarts)"
    )
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("requests", summary["requests"]),
        ("completed", summary["completed"]),
        ("errors (clear)", summary["errors"]),
        ("lost", summary["lost"]),
        ("hung up early (by design)", summary["hung_up"]),
        ("error rate", f(100 * summary["error_rate"], " %", 2)),
        ("throughput", f(summary["throughput_rps"], " req/s", 1)),
        ("latency p50", f(summary["latency_p50_s"], " s")),
        ("latency p99", f(summary["latency_p99_s"], " s")),
        ("latency max", f(summary["latency_max_s"], " s")),
        ("TTFT p50", f(summary["ttft_p50_s"], " s")),
        ("TTFT p99", f(summary["ttft_p99_s"], " s")),
        ("router RSS first 10%", f(summary["rss_start_mib"], " MiB", 1)),
        ("router RSS last 10%", f(summary["rss_end_mib"], " MiB", 1)),
        ("router RSS max", f(summary["rss_max_mib"], " MiB", 1)),
        ("router CPU mean", f(summary["router_cpu_mean_pct"], " %", 1)),
        (
            "every gauge back to 0 (router, engines)",
            "yes"
            if summary["drained"]
            else "NO: " + ", ".join(f"{k}={v:g}" for k, v in summary["final_gauges"].items() if v),
        ),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    c = Console()
    c.print(t)
    for k, n in list(summary["failures"].items())[:8]:
        c.print(f"  x{n}  {k}")
    c.print(f"results in {out}/ (summary.json, timeline.csv, soak.png)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=2.0, help="load duration (default %(default)s)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=32, help="streaming clients in a closed loop")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--speed", type=float, default=2.0, help="simulator speed factor")
    p.add_argument(
        "--restart-every",
        type=float,
        default=20.0,
        help="seconds from one engine's restart to the next kill (default %(default)s)",
    )
    p.add_argument("--down-s", type=float, default=2.0, help="seconds an engine stays down")
    p.add_argument("--kill-signal", choices=("SIGKILL", "SIGTERM"), default="SIGKILL")
    p.add_argument("--idle-s", type=float, default=5.0, help="router timeouts.idle_s")
    p.add_argument("--request-bound-s", type=float, default=150.0, help="a request longer than this is lost (hang)")
    p.add_argument("--window", type=float, default=10.0, help="report window (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hang-up-fraction",
        type=float,
        default=0.2,
        help="requests whose client hangs up 0-300 ms after sending (default %(default)s)",
    )
    p.add_argument("--out", help="output directory (default bench/out/soak-<UTC time>)")
    args = p.parse_args(argv)
    out = Path(args.out or REPO / "bench" / "out" / time.strftime("soak-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    import uvloop

    summary_holder: dict = {}

    async def go() -> None:
        summary_holder["s"] = await soak(args, out)

    try:
        uvloop.run(go())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    summary, samples = summary_holder["s"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    with open(out / "timeline.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary["windows"][0]) if summary["windows"] else ["t"])
        w.writeheader()
        w.writerows(summary["windows"])
    with open(out / "samples.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[fl for fl in Sample.__dataclass_fields__])
        w.writeheader()
        w.writerows(asdict(x) for x in samples)
    plot(summary, samples, out / "soak.png")
    print_table(summary, out)
    return 0 if summary["lost"] == 0 and summary["drained"] else 1


if __name__ == "__main__":
    sys.exit(main())
