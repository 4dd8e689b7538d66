"""`python -m bench load-sweep`: offered load from light to past capacity (TTFT, goodput and
time to fallback against the request rate), and the rejection latency of cold probes on a
full engine."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.experiments.options import run_spec_from_args
from bench.experiments.replay import run_replay
from bench.harness.cluster import Cluster, SimOptions
from bench.harness.modes import BASELINES, PROBE, SPLIT_MODES
from bench.harness.procs import ProcessSet
from bench.harness.stats import percentile, rnd
from bench.reports.render import compare, console, line_plot, markdown_table, table

SERIES: dict[str, tuple[str, bool, float]] = {
    # name: (router strategy, engine arrival check, router probe deadline ms)
    PROBE: (PROBE, True, 250.0),
    "probe-no-arrival-check": (PROBE, False, 250.0),
    "probe-no-deadline": (PROBE, True, 600000.0),
    "probe-no-arrival-check-no-deadline": (PROBE, False, 600000.0),
    **{mode: (mode, True, 250.0) for mode in sorted(BASELINES)},
    **{mode: (mode, True, 250.0) for mode in SPLIT_MODES},
}
DEFAULT_SERIES = "probe,probe-no-arrival-check,probe-no-deadline,least_loaded,prefix_tree"
QUICK_SERIES = "probe,probe-no-arrival-check,least_loaded"
# DistServe's figure: goodput against rate for probe with each split setting and the baselines.
GOODPUT_SERIES = ",".join((PROBE, *SPLIT_MODES, *sorted(BASELINES)))


def load_sweep(a: argparse.Namespace) -> int:
    out = Path(a.out)
    if a.workload == "trace":
        console.print("[yellow]load-sweep replays the trace's requests at Poisson rates[/yellow]")
    if not a.rates:
        a.rates = "2,4,8,12,16" if not a.quick else "2,8,16"
    if a.quick and a.series == DEFAULT_SERIES:
        a.series = QUICK_SERIES
    rates = [float(r) for r in a.rates.split(",") if r]
    series = [s for s in (GOODPUT_SERIES if a.series == "goodput" else a.series).split(",") if s]
    for s in series:
        if s not in SERIES:
            raise SystemExit(f"unknown series {s!r}: one of {', '.join(SERIES)}")
    point_s = 8.0 if a.quick else 12.0
    dirs = []
    for rate in rates:  # interleaved: every series at one rate, then the next rate
        for name in series:
            strategy, arrival, deadline = SERIES[name]
            a.rate = rate
            a.no_arrival_check = not arrival
            a.probe_deadline_ms = deadline
            n = a.requests or max(40, int(rate * point_s))
            if a.workload == "prefix-groups":
                a.per_group = max(1, -(-n // a.groups))
            else:
                a.limit = n
            d = out / name / f"r{rate:g}"
            if (
                getattr(a, "resume", False)
                and (d / "summary.json").exists()
                and "sweep_series" in json.loads((d / "summary.json").read_text())
            ):
                console.print(f"[dim]load-sweep {name} at {rate:g}/s: done before, kept[/dim]")
                dirs.append(d)
                continue
            console.print(f"[bold]load-sweep[/bold] {name} at {rate:g}/s ({n} requests) -> {d}")
            spec = run_spec_from_args(a, strategy, d)
            s = asyncio.run(run_replay(spec))
            s["label"] = f"{name} @{rate:g}/s"
            s["sweep_series"] = name
            s["sweep_rate"] = rate
            (d / "summary.json").write_text(json.dumps(s, indent=2))
            dirs.append(d)
    compare(dirs, out, title=f"Load sweep: {a.workload}")
    # Goodput and time to fallback against load.
    by: dict[str, list[dict[str, Any]]] = {}
    for d in dirs:
        s = json.loads((d / "summary.json").read_text())
        by.setdefault(s["sweep_series"], []).append(s)
    trows = []
    for name, ss in by.items():
        for s in sorted(ss, key=lambda x: x["sweep_rate"]):
            trows.append(
                {
                    "series": name,
                    "rate": s["sweep_rate"],
                    "ttft_p50_ms": s["ttft_p50_ms"],
                    "ttft_p99_ms": s["ttft_p99_ms"],
                    "goodput_rps": s.get("goodput_rps"),
                    "goodput_fraction": s.get("goodput_fraction"),
                    "itl_p99_ms": s.get("itl_p99_ms"),
                    "producer_utilisation": s.get("producer_utilisation"),
                    "throughput_rps": s.get("throughput_rps"),
                    "hit_ratio": s.get("hit_ratio"),
                    "pd_share": (s.get("routes") or {}).get("pd", 0) / max(1, s["requests"]),
                    "probe_rejected_p50_ms": s.get("probe_rejected_p50_ms"),
                    "probe_rejected_p99_ms": s.get("probe_rejected_p99_ms"),
                    "expiries": s.get("probe_deadline_expiries"),
                    "ttft_pd_p50_ms": s.get("ttft_pd_p50_ms"),
                    "errors": s["errors"],
                }
            )
    cols = [
        ("series", "series"),
        ("rate", "offered/s"),
        ("throughput_rps", "done/s"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("goodput_rps", f"goodput/s (TTFT<={a.slo_ttft_ms:g}ms, ITL<={a.slo_itl_ms:g}ms)"),
        ("itl_p99_ms", "ITL p99 ms"),
        ("producer_utilisation", "producer util"),
        ("goodput_fraction", "SLO ok"),
        ("hit_ratio", "hit ratio"),
        ("pd_share", "P/D share"),
        ("probe_rejected_p50_ms", "time to reject p50 ms"),
        ("probe_rejected_p99_ms", "time to reject p99 ms"),
        ("expiries", "deadline expiries"),
        ("ttft_pd_p50_ms", "TTFT of P/D p50 ms"),
        ("errors", "err"),
    ]
    nd = {"goodput_fraction": 3, "hit_ratio": 3, "pd_share": 3, "producer_utilisation": 3}
    console.print(table("Load sweep: latency, goodput and time to fallback", cols, trows, nd))
    (out / "load_sweep.md").write_text(markdown_table(cols, trows, nd) + "\n")
    (out / "load_sweep.json").write_text(json.dumps(trows, indent=2))
    line_plot(
        out / "goodput_vs_load.png",
        {n: [(r["rate"], r["goodput_rps"] or 0.0) for r in trows if r["series"] == n] for n in by},
        "offered load (requests/s)",
        f"goodput (req/s, TTFT<={a.slo_ttft_ms:g}ms, ITL<={a.slo_itl_ms:g}ms)",
        "Goodput against offered load",
    )
    if not a.skip_rejection:
        rej = asyncio.run(rejection_latency(out / "rejection", quick=a.quick))
        (out / "rejection_latency.json").write_text(json.dumps(rej, indent=2))
        rcols = [
            ("arrival_check", "arrival check"),
            ("probes", "probes"),
            ("rejected", "rejected"),
            ("p50_ms", "rejection p50 ms"),
            ("p99_ms", "rejection p99 ms"),
            ("max_ms", "max ms"),
        ]
        console.print(table("Rejection latency of cold probes on a saturated engine", rcols, rej["rows"]))
        with open(out / "load_sweep.md", "a") as f:
            f.write("\n" + markdown_table(rcols, rej["rows"]) + "\n")
    return 0


async def _probe_full_engine(url: str, n_probes: int) -> tuple[list[float], int]:
    """Cold probes at T=0.5 to an engine kept full: (each one's latency in ms, how many were rejected)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def long_gen(i: int) -> None:
            body = {
                "model": "sim-model",
                "prompt": f" the cache block {i}" * 20,
                "max_tokens": 400,
                "ignore_eos": True,
            }
            try:
                async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
                    await r.read()
            except (TimeoutError, aiohttp.ClientError):
                pass

        # Keep the engine full: 8 long generations for 4 slots, refilled as they end.
        stop = asyncio.Event()

        async def filler(i: int) -> None:
            k = 0
            while not stop.is_set():
                await long_gen(i * 1000 + k)
                k += 1

        fillers = [asyncio.ensure_future(filler(i)) for i in range(8)]
        await asyncio.sleep(1.0)
        lat: list[float] = []
        rejected = 0
        for j in range(n_probes):
            body = {
                "model": "sim-model",
                "prompt": f" river stone {j} window" * 30,
                "max_tokens": 8,
                "stream": True,
                "cache_hit_threshold": 0.5,
            }
            t0 = time.perf_counter()
            async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
                async for line in r.content:
                    if line.startswith(b"data: ") and b"finish_reason" in line:
                        chunk = orjson.loads(line[6:]) if not line.startswith(b"data: [DONE]") else {}
                        fr = [c.get("finish_reason") for c in chunk.get("choices") or ()]
                        if any(fr):
                            if "cache_threshold" in fr:
                                rejected += 1
                            break
            lat.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(0.05)
        stop.set()
        for f in fillers:
            f.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
    return lat, rejected


async def rejection_latency(out: Path, quick: bool = False) -> dict[str, Any]:
    """One engine with max_num_seqs 4 kept full by long generations; cold probes at T=0.5
    straight to the engine: time until the cache_threshold answer, arrival check on and off."""
    rows = []
    n_probes = 20 if quick else 50
    for arrival in (True, False):
        procs = ProcessSet(out / ("on" if arrival else "off"))
        cluster = Cluster(procs, [], [])
        try:
            sim = SimOptions(speed=1.0, max_num_seqs=4, arrival_check=arrival, num_gpu_blocks=4096)
            await cluster.start_engines(1, 0, sim)
            url = cluster.decoders[0]
            lat, rejected = await _probe_full_engine(url, n_probes)
            rows.append(
                {
                    "arrival_check": "on" if arrival else "off",
                    "probes": n_probes,
                    "rejected": rejected,
                    "p50_ms": rnd(percentile(lat, 50)),
                    "p99_ms": rnd(percentile(lat, 99)),
                    "max_ms": rnd(max(lat) if lat else None),
                }
            )
        finally:
            await cluster.stop()
    return {"rows": rows}
