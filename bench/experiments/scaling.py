"""`python -m bench scaling`: router CPU and memory as K grows, and with 1,000 open streams.

1. For K in --ks (default 2, 4, 8, 16) decode engines (simulated, no prefill engine): the
   same shared-prefix workload (K groups, so every engine can own one) through the router in
   probe mode and in round_robin mode; router CPU seconds per 1,000 requests (psutil on its
   PID), peak RSS, probes per request, TTFT.
2. 1,000 open streams: slow simulated engines keep --streams streaming requests open at once
   through the router (round_robin); router RSS idle and at the peak, KB per open stream, the
   router's own in-flight gauge at the peak, CPU, errors.
3. Idle: for each K, the router's CPU (% of one core) over --idle-s seconds with no client
   traffic, in probe mode (subscribed to every engine's KV events) and round_robin: what
   the fleet costs it before any request (health checks, /metrics scrapes every 0.5 s,
   the event streams).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.experiments.replay import run_replay
from bench.experiments.runspec import RunSpec
from bench.harness.cluster import SCRAPE_INTERVAL_S, Cluster, RouterOptions, SimOptions, metric_sum, scrape
from bench.harness.loadgen import Result, completion_body, make_session, stream_completion
from bench.harness.procs import ProcessSet, RSSSampler
from bench.harness.stats import percentile, rnd
from bench.reports.render import console, line_plot, markdown_table, table
from bench.workloads.spec import WorkloadSpec


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ks = [int(k) for k in a.ks.split(",") if k]
    n_req = a.requests
    streams = a.streams
    if a.quick:
        ks, n_req, streams = [k for k in ks if k <= 8] or ks, min(n_req, 150), min(streams, 300)
    res: dict[str, Any] = {}
    tables: list[str] = []
    if not a.idle_only:
        rows: list[dict[str, Any]] = []
        for k in ks:
            for strategy in ("probe", "round_robin"):
                w = WorkloadSpec(
                    kind="prefix-groups",
                    groups=k,
                    per_group=max(1, -(-n_req // k)),
                    system_tokens=256,
                    question_tokens=32,
                    output_tokens=16,
                    rate=20.0,
                    seed=0,
                )
                sim = SimOptions(speed=4.0, num_gpu_blocks=2048)
                d = out / f"K{k}" / strategy
                console.print(f"[bold]scaling[/bold] K={k} {strategy} -> {d}")
                s = asyncio.run(
                    run_replay(
                        RunSpec(
                            mode=strategy,
                            out=d,
                            workload=w,
                            engines=k,
                            prefill=0,
                            sim=sim,
                            router=RouterOptions(strategy=strategy, min_pd_prompt_tokens=64),
                            engines_per_process=4,
                        )
                    )
                )
                rows.append(
                    {
                        "k": k,
                        "strategy": strategy,
                        "requests": s["requests"],
                        "errors": s["errors"],
                        "router_cpu_s_per_1k": s["router_cpu_s_per_1k"],
                        "router_rss_mb": s["router_rss_mb"],
                        "probes_per_request": s["probes_per_request"],
                        "hit_ratio": s["hit_ratio"],
                        "ttft_p50_ms": s["ttft_p50_ms"],
                        "ttft_p99_ms": s["ttft_p99_ms"],
                    }
                )
        cols = [
            ("k", "K"),
            ("strategy", "strategy"),
            ("requests", "req"),
            ("errors", "err"),
            ("router_cpu_s_per_1k", "router CPU s/1k req"),
            ("router_rss_mb", "router peak RSS MB"),
            ("probes_per_request", "probes/req"),
            ("hit_ratio", "hit ratio"),
            ("ttft_p50_ms", "TTFT p50 ms"),
            ("ttft_p99_ms", "TTFT p99 ms"),
        ]
        nd = {"router_cpu_s_per_1k": 2, "probes_per_request": 2, "hit_ratio": 3}
        console.print(table("Router cost as K grows (simulated engines)", cols, rows, nd))
        line_plot(
            out / "scaling_cpu.png",
            {
                st: [(r["k"], r["router_cpu_s_per_1k"] or 0) for r in rows if r["strategy"] == st]
                for st in ("probe", "round_robin")
            },
            "decode engines K",
            "router CPU seconds per 1,000 requests",
            "Router CPU as K grows",
            logx=True,
        )
        res["k_rows"] = rows
        tables.append(markdown_table(cols, rows, nd))
        console.print(f"[bold]scaling[/bold] {streams} open streams")
        res["streams"] = asyncio.run(open_streams(out / "streams", streams))
        scols = [
            ("streams", "streams"),
            ("completed", "completed"),
            ("errors", "errors"),
            ("max_router_inflight", "router in-flight at peak"),
            ("rss_idle_mb", "RSS idle MB"),
            ("rss_peak_mb", "RSS peak MB"),
            ("kb_per_stream", "KB per stream"),
            ("router_cpu_s", "router CPU s"),
            ("ttft_p50_ms", "TTFT p50 ms"),
            ("wall_s", "wall s"),
        ]
        console.print(table("Open streams through the router (round_robin, 4 slow engines)", scols, [res["streams"]]))
        tables.append(markdown_table(scols, [res["streams"]]))
    idle_rows = [
        {"k": k, "strategy": st, **asyncio.run(idle_cpu(out / f"K{k}" / f"{st}-idle", k, st, a.idle_s))}
        for k in ks
        for st in ("probe", "round_robin")
    ]
    icols = [
        ("k", "K"),
        ("strategy", "strategy"),
        ("cpu_pct", "router CPU % of a core"),
        ("scrapes_per_s", "scrapes/s"),
    ]
    console.print(table(f"Router CPU with no traffic, over {a.idle_s:g} s", icols, idle_rows, {"cpu_pct": 2}))
    res["idle_rows"] = idle_rows
    tables.append(markdown_table(icols, idle_rows, {"cpu_pct": 2}))
    (out / "scaling.json").write_text(json.dumps(res, indent=2))
    (out / "scaling.md").write_text("\n\n".join(tables) + "\n")
    return 0


async def idle_cpu(out: Path, k: int, strategy: str, seconds: float) -> dict[str, Any]:
    """The router's CPU with K engines and no traffic, after its first health round."""
    cluster = Cluster(ProcessSet(out / "logs"), [], [])
    try:
        await cluster.start_engines(k, 0, SimOptions(), engines_per_process=4)
        await cluster.start_router(RouterOptions(strategy=strategy, log_level="warning"), out)
        assert cluster.router is not None  # start_router just set it
        sampler = RSSSampler(cluster.router.pid)
        sampler.start()
        await asyncio.sleep(seconds)  # the measurement's window, not a wait for a condition
        cpu, _ = await sampler.stop()
    finally:
        await cluster.stop()
    return {"cpu_pct": rnd(100.0 * cpu / seconds, 2), "scrapes_per_s": rnd(k / SCRAPE_INTERVAL_S, 1)}


async def open_streams(out: Path, n: int) -> dict[str, Any]:
    procs = ProcessSet(out / "logs")
    cluster = Cluster(procs, [], [])
    try:
        # Slow engines (1/20 of an H100): a stream of 10 tokens stays open for seconds.
        sim = SimOptions(speed=0.05, max_num_seqs=1024, num_gpu_blocks=8192, max_num_batched_tokens=16384)
        await cluster.start_engines(4, 0, sim, engines_per_process=4)
        await cluster.start_router(RouterOptions(strategy="round_robin", log_level="warning"), out)
        assert cluster.router is not None  # start_router just set it
        sampler = RSSSampler(cluster.router.pid, interval_s=0.05)
        await asyncio.sleep(1.0)
        idle = sampler.rss()
        sampler.start()
        max_inflight = 0.0
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal max_inflight
            async with aiohttp.ClientSession() as s:
                while not stop.is_set():
                    try:
                        m = await scrape(s, cluster.url)
                        max_inflight = max(max_inflight, metric_sum(m, "cachehit_router_inflight_requests"))
                    except (TimeoutError, aiohttp.ClientError):
                        pass
                    await asyncio.sleep(0.25)

        watcher = asyncio.ensure_future(watch())
        t0 = time.perf_counter()
        async with make_session(0) as session:
            results = [Result(index=i) for i in range(n)]
            await asyncio.gather(
                *(
                    stream_completion(
                        session, cluster.url, completion_body(f" stream {i} open", 10), results[i], timeout_s=300
                    )
                    for i in range(n)
                )
            )
        wall = time.perf_counter() - t0
        stop.set()
        await watcher
        cpu, peak = await sampler.stop()
    finally:
        await cluster.stop()
    ok = [r for r in results if r.ok]
    return {
        "streams": n,
        "completed": len(ok),
        "errors": n - len(ok),
        "error_examples": sorted({r.error for r in results if not r.ok})[:3],
        "max_router_inflight": int(max_inflight),
        "rss_idle_mb": rnd(idle / 2**20, 1),
        "rss_peak_mb": rnd(peak / 2**20, 1),
        "kb_per_stream": rnd((peak - idle) / 1024 / n, 1),
        "router_cpu_s": rnd(cpu, 2),
        "ttft_p50_ms": rnd(percentile([r.ttft_ms for r in ok if r.ttft_ms is not None], 50)),
        "wall_s": rnd(wall, 2),
    }
