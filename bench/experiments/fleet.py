"""`python -m bench fleet`: router replicas N = 1, 2, 4 on several workloads, one table.

For each workload and each N, every mode runs `replay --routers N` (bench/harness/replicas.py: N
router processes in front of the same engines, requests round robin over them). The table
puts each mode's hit ratio and TTFT beside its own N = 1 run, and `targets` checks what the
fleet claim needs: probe's hit ratio at the largest N within 3% (relative) of N = 1, and
probe's TTFT p50 and p99 at the largest N below each index-based mode's there. With
`--restart-engine-at S` every mode also runs once at the largest N with one decode engine
restarted S seconds in; `recovery` reads how many requests after it the hit ratio took to
come back.

The table is built from the summaries alone (`fleet_rows`, `targets`, `recovery_rows`),
so `--resume` re-tabulates runs that are done without running them again.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
from pathlib import Path
from typing import Any

from bench.experiments.options import run_spec_from_args
from bench.experiments.replay import run_replay
from bench.harness.cluster import peer_executable
from bench.harness.modes import PEER_EXECUTABLES
from bench.reports.fleet_table import fleet_rows, recovery_rows, targets, write_tables
from bench.reports.render import console


def available_modes(modes: list[str]) -> tuple[list[str], list[str]]:
    """(modes that can run here, modes left out because their router is not installed)."""
    ok, missing = [], []
    for m in modes:
        exe = PEER_EXECUTABLES.get(m)
        try:
            if exe:
                peer_executable(exe)
            ok.append(m)
        except RuntimeError:
            missing.append(m)
    return ok, missing


def _args_for(a: argparse.Namespace, workload: str, mode: str, n: int, restart_s: float) -> argparse.Namespace:
    b = copy.copy(a)
    b.workload, b.routers, b.restart_engine_at = workload, n, restart_s
    if workload == "trace" and b.limit is None:
        b.limit = 400
    if restart_s > 0:
        b.engines_per_process = 1  # a restart stops one engine's process
    return b


def _run(a: argparse.Namespace, mode: str, d: Path) -> dict[str, Any]:
    done = d / "summary.json"
    if a.resume and done.exists():
        summary: dict[str, Any] = json.loads(done.read_text())
        return summary
    return asyncio.run(run_replay(run_spec_from_args(a, mode, d)))


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    workloads = [w for w in a.workloads.split(",") if w]
    ns = sorted({int(n) for n in a.routers_list.split(",") if n})
    modes, missing = available_modes([m for m in a.modes.split(",") if m])
    for m in missing:
        console.print(f"[yellow]fleet: {m} left out: its router is not installed[/yellow]")
    summaries: dict[tuple[str, str, int], dict[str, Any]] = {}
    restarts: dict[tuple[str, str], dict[str, Any]] = {}
    for workload in workloads:
        for n in ns:  # interleaved: every mode at one N, then the next N
            for mode in modes:
                d = out / workload / f"N{n}" / mode
                console.print(f"[bold]fleet[/bold] {workload} N={n} mode={mode} -> {d}")
                summaries[(workload, mode, n)] = _run(_args_for(a, workload, mode, n, 0.0), mode, d)
        if a.restart_engine_at > 0:
            for mode in modes:
                d = out / workload / f"N{ns[-1]}-restart" / mode
                console.print(f"[bold]fleet[/bold] {workload} N={ns[-1]} mode={mode}, engine restart -> {d}")
                restarts[(workload, mode)] = _run(_args_for(a, workload, mode, ns[-1], a.restart_engine_at), mode, d)
    rows = fleet_rows(summaries)
    write_tables(out, rows, targets(rows), recovery_rows(restarts))
    return 0
