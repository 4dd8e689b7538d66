"""`python -m bench offload-sweep`: hit ratio and TTFT against each engine's CPU KV tier
(F x its GPU KV capacity)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from bench.experiments.options import run_spec_from_args
from bench.experiments.replay import run_replay
from bench.harness.modes import ORACLE
from bench.reports.render import console, line_plot, markdown_table, table
from bench.workloads import generators as wl
from bench.workloads.spec import build_requests


def offload_sweep(a: argparse.Namespace) -> int:
    """Hit ratio and TTFT against each engine's CPU tier (F x its GPU KV capacity)."""
    out = Path(a.out)
    factors = [float(f) for f in a.factors.split(",") if f]
    modes = [m for m in a.modes.split(",") if m]
    if a.workload == "trace" and a.limit is None:
        a.limit, a.window = 1500, "head"
    spec0 = run_spec_from_args(a, ORACLE, out)
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
