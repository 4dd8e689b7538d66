"""`python -m bench sweep-threshold`: probe mode at several cache-hit thresholds T: hits,
fallbacks, probe cost and TTFT against T."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from bench.experiments.options import run_spec_from_args
from bench.experiments.replay import run_replay
from bench.harness.modes import PROBE
from bench.reports.render import console, line_plot, markdown_table, table


def sweep_threshold(a: argparse.Namespace) -> int:
    out = Path(a.out)
    thresholds = [float(t) for t in a.thresholds.split(",") if t]
    if a.workload == "trace" and a.limit is None:
        a.limit = 300
    rows, dirs = [], []
    for t in thresholds:
        a.threshold = t
        d = out / f"T{t:g}"
        console.print(f"[bold]sweep-threshold[/bold] T={t:g} -> {d}")
        spec = run_spec_from_args(a, PROBE, d)
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
