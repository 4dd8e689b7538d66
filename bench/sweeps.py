"""Threshold sweep (hits, fallbacks, probe cost and TTFT against T) and offered-load sweep
(TTFT against the request rate)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import orjson

from .cluster import Cluster, SimOptions
from .procs import ProcessSet
from .report import compare, console, line_plot, markdown_table, table
from .stats import percentile, rnd

# --- threshold sweep --------------------------------------------------------------------


def sweep_threshold(a) -> int:
    from .__main__ import run_spec_from_args
    from .replay import run_replay

    out = Path(a.out)
    thresholds = [float(t) for t in a.thresholds.split(",") if t]
    if a.workload == "trace" and a.limit is None:
        a.limit = 300
    rows, dirs = [], []
    for t in thresholds:
        a.threshold = t
        d = out / f"T{t:g}"
        console.print(f"[bold]sweep-threshold[/bold] T={t:g} -> {d}")
        spec = run_spec_from_args(a, "probe", d)
        s = asyncio.run(run_replay(spec))
        s["label"] = f"probe T={t:g}"
        (d / "summary.json").write_text(json.dumps(s, indent=2))
        routes = s.get("router_routes") or {}
        n = s["requests"] or 1
        rows.append(
            {
                "threshold": t,
                "hit_ratio": s["hit_ratio"],
                "oracle_hit_ratio": s["oracle_hit_ratio"],
                "pd_share": routes.get("pd", 0) / n,
                "probe_hit_share": routes.get("probe_hit", 0) / n,
                "direct_share": routes.get("direct", 0) / n,
                "probes_per_request": s.get("probes_per_request"),
                "rejections_per_request": (s.get("probe_rejections") or 0) / n,
                "losers_per_request": (s.get("probe_losers") or 0) / n,
                "loser_tokens_pct": s.get("loser_tokens_pct_of_output"),
                "ttft_p50_ms": s["ttft_p50_ms"],
                "ttft_p99_ms": s["ttft_p99_ms"],
                "probe_rejected_p50_ms": s.get("probe_rejected_p50_ms"),
                "router_cpu_s_per_1k": s.get("router_cpu_s_per_1k"),
                "errors": s["errors"],
            }
        )
        dirs.append(d)
    cols = [
        ("threshold", "T"),
        ("hit_ratio", "hit ratio"),
        ("oracle_hit_ratio", "oracle"),
        ("probe_hit_share", "probe hit"),
        ("pd_share", "P/D fallback"),
        ("direct_share", "direct"),
        ("probes_per_request", "probes/req"),
        ("rejections_per_request", "rejections/req"),
        ("losers_per_request", "losers/req"),
        ("loser_tokens_pct", "loser tok %"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("probe_rejected_p50_ms", "rejection p50 ms"),
        ("router_cpu_s_per_1k", "router CPU s/1k"),
        ("errors", "err"),
    ]
    nd = {
        "hit_ratio": 3,
        "oracle_hit_ratio": 3,
        "probe_hit_share": 3,
        "pd_share": 3,
        "direct_share": 3,
        "probes_per_request": 2,
        "rejections_per_request": 2,
        "losers_per_request": 3,
        "loser_tokens_pct": 3,
        "threshold": 1,
        "router_cpu_s_per_1k": 2,
    }
    console.print(table(f"Threshold sweep: probe mode, {a.workload}", cols, rows, nd))
    (out / "sweep_threshold.md").write_text(markdown_table(cols, rows, nd) + "\n")
    (out / "sweep_threshold.json").write_text(json.dumps(rows, indent=2))
    line_plot(
        out / "threshold_hit_ratio.png",
        {
            "hit ratio": [(r["threshold"], r["hit_ratio"]) for r in rows],
            "P/D fallback share": [(r["threshold"], r["pd_share"]) for r in rows],
        },
        "cache-hit threshold T",
        "fraction",
        "Hit ratio and fallbacks against the threshold",
    )
    line_plot(
        out / "threshold_ttft.png",
        {
            "TTFT p50": [(r["threshold"], r["ttft_p50_ms"]) for r in rows],
            "TTFT p99": [(r["threshold"], r["ttft_p99_ms"]) for r in rows],
        },
        "cache-hit threshold T",
        "ms",
        "TTFT against the threshold",
        logy=True,
    )
    return 0


# --- load sweep -------------------------------------------------------------------------

SERIES = {
    # name: (router strategy, engine arrival check, router probe deadline ms)
    "probe": ("probe", True, 250.0),
    "probe-no-arrival-check": ("probe", False, 250.0),
    "probe-no-deadline": ("probe", True, 600000.0),
    "probe-no-arrival-check-no-deadline": ("probe", False, 600000.0),
    "least_loaded": ("least_loaded", True, 250.0),
    "prefix_tree": ("prefix_tree", True, 250.0),
    "round_robin": ("round_robin", True, 250.0),
}


def load_sweep(a) -> int:
    from .__main__ import run_spec_from_args
    from .replay import run_replay

    out = Path(a.out)
    if a.workload == "trace":
        console.print("[yellow]load-sweep replays the trace's requests at Poisson rates[/yellow]")
    if not a.rates:
        a.rates = "2,4,8,12,16" if not a.quick else "2,8,16"
    if a.quick and a.series == load_sweep_default_series():
        a.series = "probe,probe-no-arrival-check,least_loaded"
    rates = [float(r) for r in a.rates.split(",") if r]
    series = [s for s in a.series.split(",") if s]
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
    by: dict[str, list[dict]] = {}
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
        ("goodput_rps", f"goodput/s (TTFT<={a.slo_ttft_ms:g}ms)"),
        ("goodput_fraction", "SLO ok"),
        ("hit_ratio", "hit ratio"),
        ("pd_share", "P/D share"),
        ("probe_rejected_p50_ms", "time to reject p50 ms"),
        ("probe_rejected_p99_ms", "time to reject p99 ms"),
        ("expiries", "deadline expiries"),
        ("ttft_pd_p50_ms", "TTFT of P/D p50 ms"),
        ("errors", "err"),
    ]
    nd = {"goodput_fraction": 3, "hit_ratio": 3, "pd_share": 3}
    console.print(table("Load sweep: latency, goodput and time to fallback", cols, trows, nd))
    (out / "load_sweep.md").write_text(markdown_table(cols, trows, nd) + "\n")
    (out / "load_sweep.json").write_text(json.dumps(trows, indent=2))
    line_plot(
        out / "goodput_vs_load.png",
        {n: [(r["rate"], r["goodput_rps"] or 0.0) for r in trows if r["series"] == n] for n in by},
        "offered load (requests/s)",
        f"goodput (requests/s with TTFT <= {a.slo_ttft_ms:g} ms)",
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


def load_sweep_default_series() -> str:
    return "probe,probe-no-arrival-check,probe-no-deadline,least_loaded,prefix_tree"


async def rejection_latency(out: Path, quick: bool = False) -> dict:
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
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

                async def long_gen(i: int) -> None:
                    body = {
                        "model": "sim-model",
                        "prompt": f" the cache block {i}" * 20,
                        "max_tokens": 400,
                        "ignore_eos": True,
                    }
                    try:
                        async with s.post(
                            url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)
                        ) as r:
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
                lat, rejected = [], 0
                for j in range(n_probes):
                    body = {
                        "model": "sim-model",
                        "prompt": f" river stone {j} window" * 30,
                        "max_tokens": 8,
                        "stream": True,
                        "cache_hit_threshold": 0.5,
                    }
                    t0 = time.perf_counter()
                    async with s.post(
                        url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)
                    ) as r:
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


# --- CPU-tier (KV offload) sweep --------------------------------------------------------


def offload_sweep(a) -> int:
    """Hit ratio and TTFT against each engine's CPU tier (F x its GPU KV capacity)."""
    from . import workloads as wl
    from .__main__ import run_spec_from_args
    from .replay import build_requests, run_replay

    out = Path(a.out)
    factors = [float(f) for f in a.factors.split(",") if f]
    modes = [m for m in a.modes.split(",") if m]
    if a.workload == "trace" and a.limit is None:
        a.limit, a.window = 1500, "head"
    spec0 = run_spec_from_args(a, "oracle", out)
    oracle = wl.oracle_for_requests(build_requests(spec0.workload), spec0.sim.block_size)["oracle_hit_ratio"]
    rows = []
    for f in factors:
        for mode in modes:
            a.cpu_offload_x = f
            d = out / f"F{f:g}" / mode
            if a.resume and (d / "summary.json").exists():
                s = json.loads((d / "summary.json").read_text())
            else:
                console.print(f"[bold]offload-sweep[/bold] F={f:g} {mode} -> {d}")
                s = asyncio.run(run_replay(run_spec_from_args(a, mode, d)))
                s["label"] = f"{mode} F={f:g}"
                (d / "summary.json").write_text(json.dumps(s, indent=2))
            hit = s["hit_ratio"]
            rows.append(
                {
                    "F": f,
                    "mode": mode,
                    "hit_ratio": hit,
                    "oracle_hit_ratio": oracle,
                    "pct_of_oracle": 100 * hit / oracle if hit is not None and oracle else None,
                    "cpu_tier_share": (s.get("cpu_tier_hit_tokens") or 0) / s["prompt_tokens"]
                    if s.get("prompt_tokens")
                    else None,
                    "ttft_p50_ms": s["ttft_p50_ms"],
                    "ttft_p99_ms": s["ttft_p99_ms"],
                    "errors": s["errors"],
                }
            )
    rr = {r["F"]: r["ttft_p50_ms"] for r in rows if r["mode"] == "round_robin"}
    for r in rows:
        base = rr.get(r["F"])
        r["ttft_p50_vs_rr"] = r["ttft_p50_ms"] / base if base and r["ttft_p50_ms"] is not None else None
    cols = [
        ("F", "F"),
        ("mode", "mode"),
        ("hit_ratio", "hit ratio"),
        ("pct_of_oracle", "% of oracle"),
        ("cpu_tier_share", "CPU-tier hits / prompt"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p50_vs_rr", "p50 / round_robin"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("errors", "err"),
    ]
    nd = {"F": 0, "hit_ratio": 3, "pct_of_oracle": 1, "cpu_tier_share": 3, "ttft_p50_vs_rr": 2}
    title = f"CPU tier F x GPU KV: {a.workload}, {a.limit} requests, oracle {oracle:.3f}"
    console.print(table(title, cols, rows, nd))
    (out / "offload_sweep.md").write_text(f"{title}\n\n" + markdown_table(cols, rows, nd) + "\n")
    (out / "offload_sweep.json").write_text(json.dumps(rows, indent=2))
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in modes}
    line_plot(
        out / "offload_hit_ratio.png",
        {
            **{m: [(r["F"], r["hit_ratio"]) for r in rs] for m, rs in by_mode.items()},
            "oracle": [(f, oracle) for f in factors],
        },
        "CPU tier (x GPU KV capacity)",
        "hit ratio",
        "Hit ratio against the CPU tier",
    )
    line_plot(
        out / "offload_ttft.png",
        {
            **{f"{m} p50": [(r["F"], r["ttft_p50_ms"]) for r in rs] for m, rs in by_mode.items()},
            **{f"{m} p99": [(r["F"], r["ttft_p99_ms"]) for r in rs] for m, rs in by_mode.items()},
        },
        "CPU tier (x GPU KV capacity)",
        "ms",
        "TTFT against the CPU tier",
        logy=True,
    )
    return 0
