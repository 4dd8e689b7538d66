"""The soak's results: windows over time, the summary, the plot and the terminal table."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench.experiments.soak_load import Run, Sample


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def windows(run: Run, width: float) -> list[dict[str, Any]]:
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


def summarize(run: Run, args: argparse.Namespace, drained: bool, final_rss: float) -> dict[str, Any]:
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
        "truncated": sum(r.kind == "truncated" for r in run.results),
        "duplicated": sum(r.kind == "duplicated" for r in run.results),
        "http_5xx": sum(r.status >= 500 for r in run.results),
        "hung_up": sum(r.kind == "hung_up" for r in run.results),
        "error_rate": (
            sum(r.kind not in ("completed", "hung_up") for r in run.results) / len(run.results) if run.results else 0.0
        ),
        "throughput_rps": len(ok) / run.samples[-1].t if run.samples else 0.0,
        "latency_p50_s": _pct(lat, 0.5),
        "latency_p99_s": _pct(lat, 0.99),
        "latency_max_s": max(lat) if lat else None,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "rss_start_mib": statistics.mean(rss[:n_first]) if rss else None,
        # After warm-up: the second tenth of the run (the first holds start-up's growth).
        "rss_warm_mib": statistics.mean(rss[n_first : 2 * n_first]) if len(rss) >= 2 * n_first else None,
        "rss_end_mib": statistics.mean(rss[-n_first:]) if rss else None,
        "rss_max_mib": max(rss) if rss else None,
        "rss_final_mib": final_rss,
        "router_cpu_mean_pct": statistics.mean(s.cpu_pct for s in run.samples) if run.samples else None,
        "restarts": [{"t": t, "engine": n} for t, n in run.restarts],
        "drained": drained,
        "backends_at_end": run.backends_at_end,
        "churn_steps": run.churn_steps,
        "final_gauges": run.final_gauges,
        "failures": dict(sorted(errors.items(), key=lambda kv: -kv[1])),
        "windows": windows(run, args.window),
    }


def plot(run_summary: dict[str, Any], samples: list[Sample], path: Path) -> None:
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


def print_table(summary: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(v: object, unit: str = "", nd: int = 3) -> str:
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
        ("truncated", summary["truncated"]),
        ("duplicated tokens", summary["duplicated"]),
        ("5xx", summary["http_5xx"]),
        ("hung up early (by design)", summary["hung_up"]),
        ("error rate", f(100 * summary["error_rate"], " %", 2)),
        ("throughput", f(summary["throughput_rps"], " req/s", 1)),
        ("latency p50", f(summary["latency_p50_s"], " s")),
        ("latency p99", f(summary["latency_p99_s"], " s")),
        ("latency max", f(summary["latency_max_s"], " s")),
        ("TTFT p50", f(summary["ttft_p50_s"], " s")),
        ("TTFT p99", f(summary["ttft_p99_s"], " s")),
        ("router RSS first 10%", f(summary["rss_start_mib"], " MiB", 1)),
        ("router RSS after warm-up (10-20%)", f(summary["rss_warm_mib"], " MiB", 1)),
        ("router RSS last 10%", f(summary["rss_end_mib"], " MiB", 1)),
        ("router RSS max", f(summary["rss_max_mib"], " MiB", 1)),
        ("router CPU mean", f(summary["router_cpu_mean_pct"], " %", 1)),
        ("fleet churn steps", summary["churn_steps"]),
        (
            "backends at the end",
            ", ".join(summary.get("backends_at_end", [])) or "-",
        ),
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
