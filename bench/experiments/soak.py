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
With `--churn-every S` (default 0: off) the fleet churns meanwhile, one step every ~S
seconds (bench/experiments/soak_churn.py): SIGHUP reloads that add, move (to one of
`--spares` extra engines) and remove a backend, flip-flops of it, admin adds, deletes,
drains and enables; `--stall-engine NAME` SIGSTOPs that engine 1.5 s of every 3 s for
`--stall-burst-s`, then leaves it alone as long, and again. Requests are also classified
truncated (fewer tokens than asked, or no [DONE]) and duplicated (more token ids streamed
than asked), and 5xx answers (status or error event) are counted.
Exit status 1 when a request was lost, truncated or duplicated, a 5xx was answered, or a
gauge did not return to 0 (or the fleet did not end as configured).

The churn soak (docs/RELIABILITY.md):
    python -m bench soak --minutes 10 --concurrency 50 --churn-every 5 --stall-engine d1

Default run: 2 minutes, 4 engines, 32 streams. A longer run (docs/RELIABILITY.md):
    python -m bench soak --minutes 60 --concurrency 64 --restart-every 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import tomli_w

from bench.experiments.soak_churn import ADMIN_KEY, Churn, backends_listed, churner, staller
from bench.experiments.soak_load import (
    ENGINE_GAUGES,
    GAUGES,
    Run,
    Sample,
    hang_up_early,
    metrics_value,
    one_request,
)
from bench.experiments.soak_procs import (
    REPO,
    Engine,
    cpu_seconds,
    router_config,
    rss_bytes,
    start_router,
    stop_group,
    wait_http,
)
from bench.experiments.soak_report import plot, print_table, summarize
from bench.harness.procs import free_ports


async def soak(args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], list[Sample]]:
    *engine_ports, port = free_ports(args.engines + args.spares + 1)
    engines = [Engine(f"d{i}", p, ["--speed", str(args.speed)], out / f"d{i}.log") for i, p in enumerate(engine_ports)]
    engines, spares = engines[: args.engines], engines[args.engines :]
    for i, e in enumerate(spares):
        e.name, e.log = f"s{i}", out / f"s{i}.log"
    router_proc: subprocess.Popen[bytes] | None = None
    run = Run()
    try:
        for e in engines + spares:
            e.start()
        config = router_config(port, engines, args)
        config["server"]["admin_api_key"] = ADMIN_KEY
        router_proc = start_router(out, tomli_w.dumps(config))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 60, router_proc)
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
                last_cpu, last_t = cpu_seconds(pid), time.monotonic()
                seen = 0
                inflight = 0.0
                while not stop.is_set():
                    await asyncio.sleep(1.0)
                    now = time.monotonic()
                    cpu = cpu_seconds(pid)
                    new = run.results[seen:]
                    seen = len(run.results)
                    with contextlib.suppress(Exception):
                        inflight = await metrics_value(s, url, "cachehit_router_inflight_requests")
                    run.samples.append(
                        Sample(
                            now - t0,
                            rss_bytes(pid) / 2**20,
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
            churn = Churn(config, out / "router.toml", router_proc, url, engines, spares, t0, random.Random(args.seed))
            if args.churn_every > 0 and spares:
                aux.append(asyncio.create_task(churner(churn, s, args.churn_every, stop)))
            stalling = [e for e in engines if e.name == args.stall_engine]
            if stalling:
                aux.append(asyncio.create_task(staller(churn, stalling[0], args.stall_burst_s, stop)))
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            stop.set()
            await asyncio.gather(*workers)
            for t in aux:
                t.cancel()
            await asyncio.gather(*aux, return_exceptions=True)
            await churn.undo(s)
            base = sorted(e.name for e in engines)
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
                listed = await backends_listed(churn, s)
                if not any(gauges.values()) and listed == base:
                    drained = True
                    break
                await asyncio.sleep(0.1)
            run.final_gauges = gauges
            run.backends_at_end = await backends_listed(churn, s)
            run.churn_steps = len(churn.steps)
        final_rss = rss_bytes(pid) / 2**20
    finally:
        stop_group(router_proc)
        for e in engines + spares:
            stop_group(e.proc)
    return summarize(run, args, drained, final_rss), run.samples


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
    p.add_argument("--churn-every", type=float, default=0.0, help="seconds between fleet churn steps (0: none)")
    p.add_argument("--spares", type=int, default=2, help="extra engines the churn adds and moves backends to")
    p.add_argument("--stall-engine", default="", help="an engine to SIGSTOP 1.5 s of every 3 s, in bursts")
    p.add_argument("--stall-burst-s", type=float, default=30.0, help="length of a stall burst and of the pause after")
    p.add_argument("--out", help="output directory (default bench/out/soak-<UTC time>)")
    args = p.parse_args(argv)
    out = Path(args.out or REPO / "bench" / "out" / time.strftime("soak-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    import uvloop

    summary_holder: dict[str, Any] = {}

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
    broken = summary["lost"] + summary["truncated"] + summary["duplicated"] + summary["http_5xx"]
    return 0 if broken == 0 and summary["drained"] else 1


if __name__ == "__main__":
    sys.exit(main())
