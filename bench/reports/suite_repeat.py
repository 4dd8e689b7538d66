"""The repeated routing suite's tables (`bench suite --repeat N`): medians over rounds and
paired ratios per round, with an A/A control as the noise floor.

One run per mode cannot judge a routing change on a shared machine: two runs of the same
mode move TTFT p50 by up to 1.4x. Each round runs every mode once on the same trace, so
the modes of one round share that moment's load; comparing them round by round (paired)
and showing how far two runs of the same mode land apart in one round (`MODE~control`
against `MODE`) says which gaps are larger than the noise. Pure functions over the rows
`suite_row` makes (each with a "round"); definitions: docs/BENCHMARKS.md, "suite".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.harness.modes import ORACLE, control_label, routing_mode
from bench.harness.stats import median, rnd
from bench.reports.render import console, fmt, markdown_table, table
from bench.reports.suite_report import add_regret, load_line, plot_regret

MEDIAN_COLUMNS = [
    ("workload", "workload"),
    ("mode", "mode"),
    ("rounds", "rounds"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("itl_p99_ms", "ITL p99 ms"),
    ("goodput_fraction", "goodput TTFT+ITL"),
    ("hit_ratio", "hit ratio"),
    ("share_pd", "P/D share"),
]
MEDIAN_KEYS = [k for k, _ in MEDIAN_COLUMNS[3:]]
MEDIAN_ND = {"goodput_fraction": 3, "hit_ratio": 3, "share_pd": 2}

PAIRED_COLUMNS = [
    ("workload", "workload"),
    ("pair", "pair"),
    ("ttft_p50_gmean", "TTFT p50 ratio gmean"),
    ("ttft_p50_range", "min-max"),
    ("ttft_p50_no_worse", "no worse"),
    ("ttft_p99_gmean", "TTFT p99 ratio gmean"),
    ("ttft_p99_range", "min-max"),
    ("ttft_p99_no_worse", "no worse"),
    ("goodput_median", "goodput diff median"),
    ("goodput_range", "min-max"),
    ("goodput_no_worse", "no worse"),
]

CONTROL_PAIR = "A/A control"


def is_control(row: dict[str, Any]) -> bool:
    return bool(row["mode"] != routing_mode(row["mode"]))


def add_round_regret(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`add_regret` within each round of each workload. A control is judged as the mode it
    repeats would be: against the other modes, neither against that mode nor judging it."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["round"]), []).append(r)
    for group in groups.values():
        add_regret([r for r in group if not is_control(r)])
        for c in filter(is_control, group):
            others = [dict(o) for o in group if routing_mode(o["mode"]) != routing_mode(c["mode"])]
            add_regret([c, *others])  # the copies' own regret is not kept
    return rows


def measured(row: dict[str, Any]) -> bool:
    return "failed" not in row


def median_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and mode (in the rows' order): the median over its measured rounds of
    each MEDIAN_KEYS value, and "rounds" = measured / run."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["mode"]), []).append(r)
    out = []
    for (workload, mode), group in groups.items():
        ok = [r for r in group if measured(r)]
        row: dict[str, Any] = {"workload": workload, "mode": mode, "rounds": f"{len(ok)}/{len(group)}"}
        for k in MEDIAN_KEYS:
            row[k] = median(r[k] for r in ok if r.get(k) is not None)
        out.append(row)
    return out


def geomean(xs: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def paired(
    by_round_a: dict[int, dict[str, Any]],
    by_round_b: dict[int, dict[str, Any]],
    key: str,
    combine: Callable[[float, float], float | None],
) -> list[float]:
    """combine(a, b) of `key` in every round both a and b measured (None: left out)."""
    values = []
    for k in sorted(by_round_a.keys() & by_round_b.keys()):
        a, b = by_round_a[k].get(key), by_round_b[k].get(key)
        if a is not None and b is not None and (v := combine(a, b)) is not None:
            values.append(v)
    return values


def ratio(a: float, b: float) -> float | None:
    return a / b if a > 0 and b > 0 else None  # a geometric mean needs positive ratios


def compare_pair(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """a against b, round by round: TTFT pX ratios a / b (geometric mean, min, max, rounds
    with a ratio <= 1) and goodput differences a - b (median, min, max, rounds >= 0)."""
    out: dict[str, Any] = {}
    for q in ("p50", "p99"):
        xs = paired(a, b, f"ttft_{q}_ms", ratio)
        out[f"ttft_{q}_ratio"] = {
            "gmean": rnd(geomean(xs), 4),
            "min": rnd(min(xs, default=None), 4),
            "max": rnd(max(xs, default=None), 4),
            "no_worse": sum(x <= 1.0 for x in xs),
            "rounds": len(xs),
        }
    ds = paired(a, b, "goodput_fraction", lambda x, y: x - y)
    out["goodput_diff"] = {
        "median": rnd(median(ds), 4),
        "min": rnd(min(ds, default=None), 4),
        "max": rnd(max(ds, default=None), 4),
        "no_worse": sum(d >= 0.0 for d in ds),
        "rounds": len(ds),
    }
    return out


def paired_rows(rows: Sequence[dict[str, Any]], reference: str | None, control: str | None) -> list[dict[str, Any]]:
    """Per workload: the reference against every other measured mode (not the oracle, not a
    control), then the control against the mode it repeats ("A/A control")."""
    by: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for r in rows:
        if measured(r):
            by.setdefault((r["workload"], r["mode"]), {})[r["round"]] = r
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        modes = list(dict.fromkeys(r["mode"] for r in rows if r["workload"] == workload))
        others = [m for m in modes if m not in (ORACLE, reference) and m == routing_mode(m)]
        pairs = [(reference, m, f"{reference} vs {m}") for m in others]
        if control is not None:
            pairs.append((control_label(control), control, CONTROL_PAIR))
        for a, b, name in pairs:
            if a is None:
                continue
            # A mode that never measured keeps its row: 0 rounds says so.
            stats = compare_pair(by.get((workload, a), {}), by.get((workload, b), {}))
            out.append({"workload": workload, "pair": name, "a": a, "b": b, **stats})
    return out


def paired_cells(row: dict[str, Any]) -> dict[str, Any]:
    """One paired row as the table's cells: "lo-hi" ranges and "k/n" rounds."""

    def span(s: dict[str, Any], nd: int) -> str:
        return "-" if s["min"] is None else f"{fmt(s['min'], nd)}-{fmt(s['max'], nd)}"

    cells = {"workload": row["workload"], "pair": row["pair"]}
    for q in ("p50", "p99"):
        s = row[f"ttft_{q}_ratio"]
        cells[f"ttft_{q}_gmean"] = fmt(s["gmean"], 2)
        cells[f"ttft_{q}_range"] = span(s, 2)
        cells[f"ttft_{q}_no_worse"] = f"{s['no_worse']}/{s['rounds']}"
    g = row["goodput_diff"]
    cells["goodput_median"] = fmt(g["median"], 3)
    cells["goodput_range"] = span(g, 3)
    cells["goodput_no_worse"] = f"{g['no_worse']}/{g['rounds']}"
    return cells


def how_to_read(reference: str | None, control: str | None) -> str:
    text = (
        f"Each pair is compared round by round (the same trace, the same moment): TTFT ratio = "
        f"{reference} / other (below 1: {reference} faster), goodput diff = {reference} - other "
        f"(above 0: {reference} kept more requests within both SLOs); 'no worse' counts the rounds "
        f"where {reference} was at least as good."
    )
    if control is None:
        return text + " Without --control there is no noise floor to judge a gap against."
    return text + (
        f" The A/A control is {control_label(control)} / {control}: two runs of the same mode in one round, "
        "the noise floor. A gap is a finding only if it lies outside the control's min-max."
    )


def write_repeated(
    out: Path, rows: list[dict[str, Any]], loads: dict[str, dict[str, Any] | None], config: dict[str, Any]
) -> list[Path]:
    """OUT/suite.md (medians and paired tables), OUT/suite.json (every round's rows and the
    aggregate) and OUT/regret.png (regret of the medians, controls left out). config names
    the rounds ("repeat"), the "reference" mode and the "control" mode (or None)."""
    reference, control = config["reference"], config["control"]
    add_round_regret(rows)
    medians, pairs = median_rows(rows), paired_rows(rows, reference, control)
    header = [load_line(name, loads.get(name)) for name in loads]
    title = f"Routing suite, {config['repeat']} rounds: medians over rounds"
    paired_title = f"{reference} against each mode, paired by round"
    cells = [paired_cells(p) for p in pairs]
    reading = how_to_read(reference, control)
    for t in (table(title, MEDIAN_COLUMNS, medians, MEDIAN_ND), table(paired_title, PAIRED_COLUMNS, cells)):
        console.print(t)
    console.print(reading)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# {title}", "", *[f"- {h}" for h in header], ""]
    md += [markdown_table(MEDIAN_COLUMNS, medians, MEDIAN_ND), "", f"## {paired_title}", ""]
    md += [markdown_table(PAIRED_COLUMNS, cells), "", reading, ""]
    (out / "suite.md").write_text("\n".join(md))
    aggregate = {"reference": reference, "control": control, "medians": medians, "paired": pairs}
    data = {"config": config, "loads": loads, "rows": rows, "aggregate": aggregate}
    (out / "suite.json").write_text(json.dumps(data, indent=2))
    written = [out / "suite.md", out / "suite.json"]
    p = plot_regret(out / "regret.png", add_regret([dict(m) for m in medians if not is_control(m)]))
    if p:
        written.append(p)
    return written
