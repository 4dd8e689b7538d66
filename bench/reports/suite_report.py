"""The routing suite's table: rows per (workload, mode), regret, the cost model's accuracy, plots.

Pure functions over summaries and request rows (no processes): `suite_row` turns one run's
summary.json and requests.jsonl into a row, `add_regret` divides each mode's TTFT by the best
other mode's of the same workload, `model_accuracy` compares the router's predicted TTFT with
the observed one. Definitions: docs/BENCHMARKS.md, "suite".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.modes import ORACLE
from bench.harness.stats import median, rnd
from bench.reports.render import console, markdown_table, table

# The policies a routing change is measured against: regret 1.0 is the best of them.
ROUTES = ("probe_hit", "pd", "direct")

COLUMNS = [
    ("workload", "workload"),
    ("mode", "mode"),
    ("requests", "req"),
    ("errors", "err"),
    ("hit_ratio", "hit ratio"),
    ("oracle_hit_ratio", "oracle hit"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("regret_p50", "regret p50"),
    ("regret_p99", "regret p99"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p99_ms", "ITL p99 ms"),
    ("goodput_fraction", "goodput TTFT+ITL"),
    ("goodput_gap", "goodput - best other"),
    ("goodput_ttft_fraction", "goodput TTFT only"),
    ("producer_utilisation", "producer util"),
    ("probes_per_request", "probes/req"),
    ("share_probe_hit", "probe_hit"),
    ("share_pd", "pd"),
    ("share_direct", "direct"),
    ("pred_abs_err_p50_ms", "pred |err| p50 ms"),
    ("pred_bias_p50_ms", "pred bias p50 ms"),
    ("pred_rel_err_p50", "pred rel err p50"),
    ("pred_engine_ratio", "pred/obs by engine"),
]
# Requests an engine must have served for its own pred/obs median to count.
ENGINE_MIN_REQUESTS = 5
ND = {
    "hit_ratio": 3,
    "oracle_hit_ratio": 3,
    "regret_p50": 2,
    "regret_p99": 2,
    "share_probe_hit": 2,
    "share_pd": 2,
    "share_direct": 2,
    "pred_rel_err_p50": 2,
    "goodput_fraction": 3,
    "goodput_gap": 3,
    "goodput_ttft_fraction": 3,
    "producer_utilisation": 3,
}


def model_accuracy(requests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Errors of the cost model's TTFT prediction over the requests that carry one:
    error = predicted_ttft_ms - observed, observed = the router's own TTFT of the request
    (`router_ttft_ms`, from the same log line as the prediction). Medians of |error|, of the
    signed error (bias: > 0 means the model predicts too slow) and of |error| / observed;
    and per engine (the one that decoded: `winner`) the median of predicted / observed,
    the lowest and highest of those (an engine the model takes for faster or slower than it
    is, which the fleet's medians hide), over engines of `ENGINE_MIN_REQUESTS` requests or more."""
    # (predicted, observed, engine that decoded) of every request that carries both figures.
    rows = [
        (r["predicted_ttft_ms"], r["router_ttft_ms"], r.get("winner"))
        for r in requests
        if r.get("predicted_ttft_ms") is not None and r.get("router_ttft_ms") is not None
    ]
    if not rows:
        return {
            "pred_requests": 0,
            "pred_abs_err_p50_ms": None,
            "pred_bias_p50_ms": None,
            "pred_rel_err_p50": None,
            "pred_engine_ratio": None,
        }
    errs = [p - o for p, o, _ in rows]
    rel = [abs(p - o) / o for p, o, _ in rows if o > 0]
    by_engine: dict[str, list[float]] = {}
    for p, o, engine in rows:
        if o and engine:
            by_engine.setdefault(engine, []).append(p / o)
    ratios = [m for v in by_engine.values() if len(v) >= ENGINE_MIN_REQUESTS and (m := median(v)) is not None]
    return {
        "pred_requests": len(rows),
        "pred_abs_err_p50_ms": rnd(median(abs(e) for e in errs), 2),
        "pred_bias_p50_ms": rnd(median(errs), 2),
        "pred_rel_err_p50": rnd(median(rel), 4),
        "pred_engine_ratio": f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else None,
    }


def route_shares(routes: dict[str, Any] | None) -> dict[str, Any]:
    """Shares of the routes the answered requests took (None when no route is known)."""
    routes = routes or {}
    total = sum(routes.values())
    return {f"share_{r}": (routes.get(r, 0) / total if total else None) for r in ROUTES}


def suite_row(workload: str, summary: dict[str, Any], requests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    mode = summary.get("mode")
    row = {"workload": workload, "mode": mode}
    for k in (
        "requests",
        "errors",
        "hit_ratio",
        "oracle_hit_ratio",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "ttft_p90_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "goodput_fraction",
        "goodput_ttft_fraction",
        "producer_utilisation",
        "throughput_rps",
        "offered_rps",
        "wall_s",
        "probes_per_request",
        "router_cpu_s_per_1k",
    ):
        row[k] = summary.get(k)
    if mode == "oracle":
        return {**row, **{f"share_{r}": None for r in ROUTES}, **model_accuracy(())}
    return {**row, **route_shares(summary.get("routes")), **model_accuracy(requests)}


def add_regret(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """regret_pX = a mode's TTFT pX / the lowest TTFT pX of every *other* mode of the same
    workload (the oracle runs nothing and is left out): below 1, the mode beat them all;
    None when no other mode ran or the mode has no TTFT."""
    for q in ("p50", "p99"):
        key = f"ttft_{q}_ms"
        for r in rows:
            v = r.get(key)
            others = [
                o[key]
                for o in rows
                if o is not r
                and o["workload"] == r["workload"]
                and o.get("mode") not in (ORACLE, r.get("mode"))
                and o.get(key) is not None
                and o[key] > 0
            ]
            r[f"regret_{q}"] = rnd(v / min(others), 4) if others and v is not None and r.get("mode") != ORACLE else None
    for r in rows:
        # Goodput against the best other mode: below 0, some other mode kept more requests.
        others = [
            o["goodput_fraction"]
            for o in rows
            if o is not r
            and o["workload"] == r["workload"]
            and o.get("mode") not in (ORACLE, r.get("mode"))
            and o.get("goodput_fraction") is not None
        ]
        v = r.get("goodput_fraction")
        r["goodput_gap"] = rnd(v - max(others), 4) if others and v is not None and r.get("mode") != ORACLE else None
    return rows


def load_line(name: str, load: dict[str, Any] | None) -> str:
    """One line of the table header: the workload's offered load (bench/experiments/capacity.py)."""
    if not load:
        return f"{name}: closed loop (each turn waits for the previous answer), utilisation not set"
    pd = load.get("pd_prefill_utilisation")
    pd_oracle, share = load.get("pd_prefill_utilisation_oracle"), load.get("decoder_prefill_share")
    factors = load.get("decoder_speed_factors")
    mixed = f" (the first at {factors} of it, the fleet's capacity counted so)" if factors else ""
    return (
        f"{name}: {load['requests']} requests over {load['span_s']:.0f} s ({load['offered_rps']:.2f} req/s), "
        f"utilisation {load['utilisation']:.2f} of K={load['engines']} decode engines at speed "
        f"{load['speed']:g}{mixed} ({load['utilisation_oracle']:.2f} with the oracle's hits)"
        + (f"; P/D prefill engines {pd:.2f} if every request fell back" if pd is not None else "")
        + (
            f" ({pd_oracle:.2f} with the oracle's hits: decoders compute at least {share:.0%} of the prompt work"
            " under any placement with a bounded producer queue)"
            if pd_oracle is not None and share is not None
            else ""
        )
    )


def write_suite(
    out: Path, rows: list[dict[str, Any]], loads: dict[str, dict[str, Any] | None], config: dict[str, Any]
) -> list[Path]:
    header = [load_line(name, loads.get(name)) for name in loads]
    title = "Routing suite: TTFT regret against the best other mode of the same run"
    t = table(title, COLUMNS, rows, ND)
    t.caption = "\n".join(header)
    console.print(t)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# {title}", "", *[f"- {h}" for h in header], "", markdown_table(COLUMNS, rows, ND), ""]
    (out / "suite.md").write_text("\n".join(md))
    (out / "suite.json").write_text(json.dumps({"config": config, "loads": loads, "rows": rows}, indent=2))
    written = [out / "suite.md", out / "suite.json"]
    p = plot_regret(out / "regret.png", rows)
    if p:
        written.append(p)
    return written


def plot_regret(path: Path, rows: list[dict[str, Any]]) -> Path | None:
    """Grouped bars: TTFT p50 and p99 regret per workload, one bar per mode."""
    rows = [r for r in rows if r.get("regret_p50") is not None or r.get("regret_p99") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["workload"], r["mode"]): r for r in rows}
    width = 0.8 / max(1, len(modes))
    fig, axes = plt.subplots(2, 1, figsize=(max(7, 1.6 * len(workloads)), 7), sharex=True)
    for ax, q in zip(axes, ("p50", "p99"), strict=False):
        vals = [1.0]
        for j, m in enumerate(modes):
            xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(workloads))]
            ys = [(by.get((w, m)) or {}).get(f"regret_{q}") or float("nan") for w in workloads]
            vals += [y for y in ys if y == y]
            # Bars grow from 1.0 (the best baseline): up is slower, down is faster.
            bars = ax.bar(xs, [y - 1.0 for y in ys], bottom=1.0, width=width, label=m)
            ax.bar_label(bars, labels=["" if y != y else f"{y:.2f}" for y in ys], fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylim(min(vals) / 1.25, max(vals) * 1.25)
        ax.set_ylabel(f"TTFT {q} regret (log)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].set_title("TTFT regret = mode / best other mode", fontsize=10)
    axes[0].legend(fontsize=8, ncol=len(modes))
    axes[1].set_xticks(range(len(workloads)))
    axes[1].set_xticklabels(workloads, rotation=15, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
