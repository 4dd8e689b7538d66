"""The fleet table (`python -m bench fleet`, bench/experiments/fleet.py): each mode's hit ratio and
TTFT at N router replicas beside its own N = 1 run, and the checks the fleet claim needs:
probe's hit ratio at the largest N within 3% (relative) of N = 1, and probe's TTFT p50 and
p99 at the largest N below each index-based mode's there; after an engine restart, how
many requests the hit ratio took to come back.

The table is built from the summaries alone (`fleet_rows`, `targets`, `recovery_rows`),
so `--resume` re-tabulates runs that are done without running them again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.reports.render import console, markdown_table, table

INDEX_MODES = ("prefix_tree", "vllm_router_cache_aware", "smg_cache_aware")
HIT_TOLERANCE = 0.03  # probe's hit ratio at the largest N may be this much (relative) below N = 1
RECOVERED = 0.97  # a window after the restart whose hit ratio is this share of before it


def fleet_rows(summaries: dict[tuple[str, str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, mode, N) from {(workload, mode, N): summary.json}, with the
    hit ratio's change against the same mode's N = 1 run (relative, %)."""
    rows = []
    for (workload, mode, n), s in sorted(summaries.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        one = summaries.get((workload, mode, 1))
        h, h1 = s.get("hit_ratio"), (one or {}).get("hit_ratio")
        rows.append(
            {
                "workload": workload,
                "mode": mode,
                "routers": n,
                "requests": s.get("requests"),
                "errors": s.get("errors"),
                "hit_ratio": h,
                "hit_vs_1_pct": round(100.0 * (h - h1) / h1, 2) if h is not None and h1 else None,
                "ttft_p50_ms": s.get("ttft_p50_ms"),
                "ttft_p99_ms": s.get("ttft_p99_ms"),
                "router_cpu_s_per_1k": s.get("router_cpu_s_per_1k"),
            }
        )
    return rows


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, at its largest N: probe's hit ratio against its N = 1 run, and probe's
    TTFT p50/p99 against each index-based mode measured there. `met` is None when a side
    is missing."""
    out = []
    for workload in sorted({r["workload"] for r in rows}):
        mine = [r for r in rows if r["workload"] == workload]
        top = max(r["routers"] for r in mine)
        at = {r["mode"]: r for r in mine if r["routers"] == top}
        probe = at.get("probe")
        d = None if probe is None else probe["hit_vs_1_pct"]
        out.append(
            {
                "workload": workload,
                "routers": top,
                "check": f"probe hit ratio at N={top} vs N=1",
                "value": d,
                "met": None if d is None else d >= -100.0 * HIT_TOLERANCE,
            }
        )
        for mode in INDEX_MODES:
            other = at.get(mode)
            for q in ("ttft_p50_ms", "ttft_p99_ms"):
                a, b = (probe or {}).get(q), (other or {}).get(q)
                out.append(
                    {
                        "workload": workload,
                        "routers": top,
                        "check": f"probe {q[:-3]} < {mode}",
                        "value": None if a is None or b is None else f"{a:.0f} vs {b:.0f}",
                        "met": None if a is None or b is None else a < b,
                    }
                )
    return out


def recovered_after(rec: dict[str, Any]) -> int | None:
    """Requests after the restart until a window's hit ratio is back to RECOVERED of the
    100 before it (the end of that window); None if no window got there."""
    before, window = rec.get("before_100"), rec.get("window") or 0
    if not before:
        return None
    for i, r in enumerate(rec.get("after") or []):
        if r is not None and r >= RECOVERED * before:
            return (i + 1) * window
    return None


def recovery_rows(restarts: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, mode) restart run: hit ratio before, per window after, and
    the requests it took to recover (target: probe within 100)."""
    rows = []
    for (workload, mode), s in sorted(restarts.items()):
        rec = s.get("recovery") or {}
        n = recovered_after(rec)
        rows.append(
            {
                "workload": workload,
                "mode": mode,
                "routers": s.get("routers"),
                "errors": s.get("errors"),
                "before_100": rec.get("before_100"),
                "after": " ".join("-" if x is None else f"{x:.2f}" for x in rec.get("after") or []),
                # Unknown, not missed, when the run ended before any window after the restart.
                "recovered_after": n,
                "within_100": None if not rec.get("after") else n is not None and n <= 100,
            }
        )
    return rows


ROW_COLS = [
    ("workload", "workload"),
    ("mode", "mode"),
    ("routers", "N"),
    ("requests", "req"),
    ("errors", "err"),
    ("hit_ratio", "hit ratio"),
    ("hit_vs_1_pct", "vs N=1 %"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("router_cpu_s_per_1k", "router CPU s/1k"),
]
TARGET_COLS = [("workload", "workload"), ("routers", "N"), ("check", "check"), ("value", "value"), ("met", "met")]
RECOVERY_COLS = [
    ("workload", "workload"),
    ("mode", "mode"),
    ("routers", "N"),
    ("errors", "err"),
    ("before_100", "hit before"),
    ("after", "hit per window after"),
    ("recovered_after", "recovered after req"),
    ("within_100", "within 100"),
]
ND = {"hit_ratio": 3, "hit_vs_1_pct": 2, "before_100": 3, "router_cpu_s_per_1k": 2}


def write_tables(out: Path, rows: list[dict[str, Any]], checks: list[dict[str, Any]], rec: list[dict[str, Any]]) -> str:
    parts = [
        "## Router replicas",
        markdown_table(ROW_COLS, rows, ND),
        "",
        "## Targets",
        markdown_table(TARGET_COLS, checks, ND),
    ]
    if rec:
        parts += ["", "## After an engine restart", markdown_table(RECOVERY_COLS, rec, ND)]
    text = "\n".join(parts) + "\n"
    (out / "fleet.md").write_text(text)
    (out / "fleet.json").write_text(json.dumps({"rows": rows, "targets": checks, "recovery": rec}, indent=2))
    console.print(table("Router replicas", ROW_COLS, rows, ND))
    console.print(table("Targets", TARGET_COLS, checks, ND))
    if rec:
        console.print(table("After an engine restart", RECOVERY_COLS, rec, ND))
    return text
