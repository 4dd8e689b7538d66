"""The routing suite: every routing mode on every suite workload, in one run, one table.

`python -m bench suite --out DIR [--quick] [--workloads a,b] [--modes m1,m2]` replays each
workload of `WORKLOADS` (bench/experiments/suite_workloads.py) through each mode
(`bench/experiments/replay.py`, a fresh cluster per mode) and writes `DIR/suite.md`,
`DIR/suite.json` and `DIR/regret.png` (`bench/reports/suite_report.py`), with each run's own
directory in `DIR/<workload>/<mode>/`. Every routing change must hold its
TTFT regret on this table (docs/BENCHMARKS.md, "suite"). With `--repeat N` each workload
runs N rounds into `DIR/<workload>/r<k>/<mode>/` and the table gives medians over rounds and
per-round paired ratios, `--control MODE` an A/A pair as their noise floor
(`bench/reports/suite_repeat.py`).

The modes of one workload run back to back, so they share the machine's load of that
moment; the order rotates from one workload to the next so that no mode always runs first
(or last) on a warming or cooling machine. Rates of the near-capacity, bursty and overload
workloads are derived from the simulator's timing model (`bench/experiments/capacity.py`), not guessed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from bench.experiments.capacity import Load, offered_load
from bench.experiments.options import add_cluster_args, add_replay_args, expand_modes, run_spec_from_args
from bench.experiments.replay import run_replay
from bench.experiments.suite_workloads import BY_NAME, SuiteWorkload
from bench.harness.modes import ORACLE, PROBE, control_label, routing_mode
from bench.harness.procs import ExitedBeforeReady
from bench.reports.render import console
from bench.reports.rundir import load_requests
from bench.reports.suite_repeat import write_repeated
from bench.reports.suite_report import add_regret, load_line, suite_row, write_suite
from bench.workloads import generators as wl
from bench.workloads.spec import build_requests

T = TypeVar("T")


def cluster_defaults() -> dict[str, Any]:
    """The cluster flags of `replay` (add_cluster_args) with their defaults: the suite passes
    them through."""
    p = argparse.ArgumentParser()
    add_cluster_args(p)
    return vars(p.parse_args([]))


def replay_args(a: argparse.Namespace, wd: SuiteWorkload, out: Path) -> argparse.Namespace:
    """The `replay` arguments of one suite workload: its flags, the suite's cluster flags."""
    p = argparse.ArgumentParser()
    add_replay_args(p)
    ns = p.parse_args(["--out", str(out), *wd.flags, *(wd.quick_flags if a.quick else ())])
    defaults = cluster_defaults()
    for k in defaults:
        setattr(ns, k, getattr(a, k))
    ns.speed = a.speed or wd.speed
    for k, v in wd.cluster:
        if getattr(a, k, None) == defaults.get(k):  # the suite's own flag wins where it is given
            setattr(ns, k, v)
    ns.trace, ns.seed = a.trace, a.seed
    if a.requests:
        cap_requests(ns, a.requests)
    return ns


def cap_requests(ns: argparse.Namespace, n: int) -> None:
    """About n requests of the workload (for small runs)."""
    if ns.workload == "prefix-groups":
        ns.per_group = max(1, -(-n // ns.groups))
    elif ns.workload == "multiturn":
        ns.sessions = max(1, -(-n // ns.turns))
    else:
        ns.limit = n


def workload_load(ns: argparse.Namespace) -> Load | None:
    """Offered load of the workload as `ns` describes it (None: multi-turn, a closed loop whose
    arrivals depend on the answers)."""
    if ns.workload == "multiturn":
        return None
    spec = run_spec_from_args(ns, ORACLE, Path(ns.out))
    reqs = build_requests(spec.workload)
    hits = wl.oracle_for_requests(reqs, spec.sim.block_size)["per_request"]
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    capacity = sum(spec.sim.decoder_speed_factors) or spec.engines  # in engines at the fleet's speed
    return offered_load(
        [r.prompt_tokens for r in reqs], hits, [r.max_tokens for r in reqs], span, spec.sim, capacity, spec.prefill
    )


def set_rate(ns: argparse.Namespace, wd: SuiteWorkload) -> dict[str, Any] | None:
    """Set the workload's arrival rate for its target utilisation; returns the resulting load."""
    load = workload_load(ns)
    if load is not None and wd.target:
        # Utilisation is work per second: proportional to the rate, inversely to the time scale.
        factor = load.utilisation / wd.target
        if ns.workload == "trace" and not ns.rate:
            ns.time_scale *= factor
        else:
            ns.rate /= factor
    if wd.bursts:
        ns.burst_on_s, ns.burst_off_s = wd.bursts
    load = workload_load(ns) if (wd.target or wd.bursts) else load
    if load is None:
        return None
    return {
        **asdict(load),
        "decoder_prefill_share": load.decoder_prefill_share,
        "engines": ns.engines,
        "prefill": ns.prefill,
        "speed": ns.speed,
        "decoder_speed_factors": ns.decoder_speed_factors,
        "target": wd.target,
        "time_scale": ns.time_scale,
        "rate": ns.rate,
    }


def mode_order(modes: list[str], i: int) -> list[str]:
    """Modes of the i-th workload: oracle first (it runs nothing), the others rotated by i."""
    rest = [m for m in modes if m != ORACLE]
    k = i % len(rest) if rest else 0
    return [m for m in modes if m == ORACLE] + rest[k:] + rest[:k]


def select(text: str, known: dict[str, T], what: str) -> list[T]:
    if text == "all":
        return list(known.values())
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in known]
    if bad or not names:
        raise SystemExit(f"unknown {what} {', '.join(bad) or '(none)'}: one of {', '.join(known)} or 'all'")
    return [known[x] for x in names]


def round_order(order: list[str], k: int, control: str | None = None) -> list[str]:
    """Modes of round k (from 1) of a repeated suite: `order` in rounds 1, 3, ..., reversed in
    rounds 2, 4, ... (the oracle stays first: it runs nothing), so each pair of modes runs in
    both orders. The control of `control` goes at the opposite end from that mode's run, so the
    A/A pair is as far apart in time as any two modes of the round."""
    head = [m for m in order if m == ORACLE]
    rest = [m for m in order if m != ORACLE]
    if k % 2 == 0:
        rest.reverse()
    if control is not None and control in rest:
        if rest.index(control) < len(rest) / 2:
            rest.append(control_label(control))
        else:
            rest.insert(0, control_label(control))
    return head + rest


def run_mode(ns: argparse.Namespace, workload: str, label: str, d: Path, failures: list[str]) -> dict[str, Any]:
    """One run of one suite label (a mode, or its control) into d, and its row; a failed run
    becomes a row with its error (one broken run must not lose the others' results)."""
    mode, where = routing_mode(label), f"{workload} mode={label}"
    console.print(f"[bold]suite[/bold] {where} -> {d}")
    try:
        try:
            s = asyncio.run(run_replay(run_spec_from_args(ns, mode, d)))
        except ExitedBeforeReady as e:  # nothing measured yet: once more, on new ports
            console.print(f"[yellow]suite[/yellow] {where}: {e}; starting it again")
            s = asyncio.run(run_replay(run_spec_from_args(ns, mode, d)))
    except Exception as e:
        traceback.print_exc()
        failures.append(f"{d}: {type(e).__name__}: {e}")
        return {"workload": workload, "mode": label, "failed": f"{type(e).__name__}: {e}"}
    if label != mode:  # `compare` shows the control under its own name
        s["label"] = label
        (d / "summary.json").write_text(json.dumps(s, indent=2))
    return {**suite_row(workload, s, load_requests(d)), "mode": label}


def suite_options(a: argparse.Namespace, modes: list[str]) -> tuple[int, str | None, str | None]:
    """(rounds, control mode, reference mode) of --repeat, --control and --reference."""
    repeat, control, reference = a.repeat, a.control, a.reference
    if repeat < 1:
        raise SystemExit("--repeat: 1 or more rounds")
    if repeat == 1:
        if control or reference:
            raise SystemExit("--control and --reference compare rounds: they need --repeat 2 or more")
        return 1, None, None
    measured = [m for m in modes if m != ORACLE]
    for flag, m in (("--control", control), ("--reference", reference)):
        if m is not None and m not in measured:
            raise SystemExit(f"{flag} {m}: one of the modes that run ({', '.join(measured)})")
    if reference is None and measured:
        reference = PROBE if PROBE in measured else measured[0]
    return repeat, control, reference


def run_suite(a: argparse.Namespace) -> int:
    out = Path(a.out)
    chosen = select(a.workloads, BY_NAME, "workload")
    modes = expand_modes(a.modes)
    repeat, control, reference = suite_options(a, modes)
    rows: list[dict[str, Any]] = []
    loads: dict[str, dict[str, Any] | None] = {}
    failures: list[str] = []
    for i, wd in enumerate(chosen):
        ns = replay_args(a, wd, out / wd.name)
        loads[wd.name] = load = set_rate(ns, wd)
        console.print(f"[bold]suite[/bold] {load_line(wd.name, load)}")
        order = mode_order(modes, i)
        for k in range(1, repeat + 1):
            # One round: every mode once on the same trace (the seed is the suite's).
            base = out / wd.name / f"r{k}" if repeat > 1 else out / wd.name
            for label in round_order(order, k, control) if repeat > 1 else order:
                if label == ORACLE and ns.workload == "multiturn":
                    continue  # its oracle needs the engines' answers: every run reports it instead
                row = run_mode(ns, wd.name, label, base / label, failures)
                rows.append({**row, "round": k} if repeat > 1 else row)
    names = [w.name for w in chosen]
    rank = {m: j for j, m in enumerate(modes)}
    # A control sorts right after the mode it repeats.
    rows.sort(
        key=lambda r: (
            names.index(r["workload"]),
            r.get("round", 1),
            rank.get(routing_mode(r["mode"]), 99),
            r["mode"] != routing_mode(r["mode"]),
        )
    )
    config: dict[str, Any] = {
        "workloads": names,
        "modes": modes,
        "quick": a.quick,
        "engines": a.engines,
        "prefill": a.prefill,
        "speed": a.speed or None,
        "seed": a.seed,
        "trace": a.trace or "generated",
        "requests": a.requests or None,
    }
    if repeat > 1:
        written = write_repeated(
            out, rows, loads, {**config, "repeat": repeat, "control": control, "reference": reference}
        )
    else:
        add_regret(rows)
        written = write_suite(out, rows, loads, config)
    for p in written:
        console.print(f"wrote {p}")
    for f in failures:
        console.print(f"[red]failed[/red] {f}")
    return 1 if failures else 0
