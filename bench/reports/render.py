"""Tables (rich) and plots (matplotlib) from run directories."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.reports.rundir import load_requests, load_summary

console = Console(width=200)


def fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{nd}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(
    title: str, columns: Sequence[tuple[str, str]], rows: Sequence[dict[str, Any]], nd: dict[str, Any] | None = None
) -> Table:
    """columns: (key, header); values formatted with fmt (nd: key -> decimals)."""
    t = Table(title=title, show_lines=False)
    for i, (_, header) in enumerate(columns):
        t.add_column(header, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*[fmt(r.get(k), (nd or {}).get(k, 1)) for k, _ in columns])
    return t


def markdown_table(
    columns: Sequence[tuple[str, str]], rows: Sequence[dict[str, Any]], nd: dict[str, Any] | None = None
) -> str:
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"
    body = ["| " + " | ".join(fmt(r.get(k), (nd or {}).get(k, 1)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


COMPARE_COLUMNS = [
    ("label", "mode"),
    ("requests", "req"),
    ("errors", "err"),
    ("offered_rps", "offered/s"),
    ("hit_ratio", "hit ratio"),
    ("pct_of_oracle", "% of oracle"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("regret_p50", "TTFT p50 regret"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p99_ms", "ITL p99 ms"),
    ("e2e_p50_ms", "e2e p50 ms"),
    ("throughput_rps", "req/s"),
    ("output_tokens_per_s", "out tok/s"),
    ("goodput_fraction", "goodput TTFT+ITL"),
    ("goodput_gap", "goodput - best other"),
    ("probes_per_request", "probes/req"),
    ("loser_tokens_pct_of_output", "loser tok %"),
    ("pd_share", "P/D share"),
    ("producer_utilisation", "producer util"),
    ("router_cpu_s_per_1k", "router CPU s/1k"),
    ("router_rss_mb", "router RSS MB"),
]
COMPARE_ND = {
    "hit_ratio": 3,
    "goodput_fraction": 3,
    "pct_of_oracle": 1,
    "probes_per_request": 2,
    "loser_tokens_pct_of_output": 3,
    "pd_share": 3,
    "producer_utilisation": 3,
    "regret_p50": 2,
    "goodput_gap": 3,
    "router_cpu_s_per_1k": 2,
}


def label_of(d: Path, s: dict[str, Any]) -> str:
    return s.get("label") or s.get("mode") or d.name


def compare_rows(dirs: Sequence[Path]) -> list[dict[str, Any]]:
    rows = []
    for d in dirs:
        s = load_summary(d)
        r = dict(s)
        r["label"] = label_of(d, s)
        r["dir"] = str(d)
        if s.get("hit_ratio") is not None and s.get("oracle_hit_ratio"):
            r["pct_of_oracle"] = 100.0 * s["hit_ratio"] / s["oracle_hit_ratio"]
        routes = s.get("routes") or {}
        total = sum(routes.values())
        r["pd_share"] = routes.get("pd", 0) / total if total else None
        rows.append(r)
    for r in rows:
        # Against the best other run of the same offered load (the oracle runs nothing).
        others = [
            o for o in rows if o is not r and o.get("offered_rps") == r.get("offered_rps") and o.get("mode") != "oracle"
        ]
        ttfts = [o["ttft_p50_ms"] for o in others if o.get("ttft_p50_ms")]
        goods = [o["goodput_fraction"] for o in others if o.get("goodput_fraction") is not None]
        mine, good = r.get("ttft_p50_ms"), r.get("goodput_fraction")
        r["regret_p50"] = mine / min(ttfts) if ttfts and mine is not None else None
        r["goodput_gap"] = good - max(goods) if goods and good is not None else None
    return rows


def compare(dirs: Sequence[Path], out: Path | None = None, title: str = "Routing modes") -> list[dict[str, Any]]:
    rows = compare_rows(dirs)
    console.print(table(title, COMPARE_COLUMNS, rows, COMPARE_ND))
    out = out or (Path(dirs[0]).parent if dirs else Path("."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(markdown_table(COMPARE_COLUMNS, rows, COMPARE_ND) + "\n")
    (out / "compare.json").write_text(
        json.dumps([{k: r.get(k) for k, _ in COMPARE_COLUMNS} | {"dir": r["dir"]} for r in rows], indent=2)
    )
    plots = plot_compare(dirs, rows, out)
    for p in plots:
        console.print(f"wrote {p}")
    return rows


def plot_compare(dirs: Sequence[Path], rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    # TTFT CDF per mode.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    any_line = False
    for d, r in zip(dirs, rows, strict=False):
        ttft = sorted(x["ttft_ms"] for x in load_requests(d) if x.get("ttft_ms") is not None)
        if not ttft:
            continue
        ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
        ax.plot(ttft, ys, label=r["label"], drawstyle="steps-post")
        any_line = True
    if any_line:
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("TTFT CDF per mode")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        p = out / "ttft_cdf.png"
        fig.tight_layout()
        fig.savefig(p, dpi=90)
        written.append(p)
    plt.close(fig)

    # Hit ratio per mode with the oracle as a line.
    hr: list[tuple[str, float]] = [(r["label"], r["hit_ratio"]) for r in rows if r.get("hit_ratio") is not None]
    if hr:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar([h[0] for h in hr], [h[1] for h in hr], color="tab:blue")
        oracle = next((r.get("oracle_hit_ratio") for r in rows if r.get("oracle_hit_ratio")), None)
        if oracle:
            ax.axhline(oracle, color="tab:red", linestyle="--", label=f"oracle {oracle:.3f}")
            ax.axhline(0.95 * oracle, color="tab:orange", linestyle=":", label="95% of oracle")
            ax.legend(fontsize=8)
        ax.set_ylabel("prefix-cache hit ratio (prompt tokens)")
        ax.set_ylim(0, 1)
        ax.set_title("Hit ratio per mode")
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
        fig.tight_layout()
        p = out / "hit_ratio.png"
        fig.savefig(p, dpi=90)
        written.append(p)
        plt.close(fig)

    # TTFT against offered load, when the runs come from a load sweep.
    series: dict[str, list[tuple[float, float, float]]] = {}
    for r in rows:
        if r.get("sweep_series") and r.get("offered_rps") and r.get("ttft_p50_ms") is not None:
            series.setdefault(r["sweep_series"], []).append(
                (r["offered_rps"], r["ttft_p50_ms"], r.get("ttft_p99_ms") or float("nan"))
            )
    if series:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for name, pts in sorted(series.items()):
            pts.sort()
            a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            a2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
        for a, t in ((a1, "TTFT p50"), (a2, "TTFT p99")):
            a.set_xlabel("offered load (requests/s)")
            a.set_ylabel(f"{t} (ms, log scale)")
            a.set_yscale("log")
            a.set_title(f"{t} against offered load")
            a.grid(True, which="both", alpha=0.3)
            a.legend(fontsize=7)
        fig.tight_layout()
        p = out / "ttft_vs_load.png"
        fig.savefig(p, dpi=90)
        written.append(p)
        plt.close(fig)
    return written


def bar_plot(
    path: Path, labels: list[str], values: list[float], ylabel: str, title: str, errs: list[float] | None = None
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(labels, values, yerr=errs, color="tab:blue", capsize=3)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def line_plot(
    path: Path,
    series: dict[str, list[tuple[float, float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    logy: bool = False,
    logx: bool = False,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in series.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
