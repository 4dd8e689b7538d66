"""The repeated suite (`bench suite --repeat N`): the order of the modes in each round, and the
tables over rounds (medians, paired ratios against the reference, the A/A control) on
hand-built rows."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.experiments.suite import round_order, suite_options
from bench.harness.modes import control_label, routing_mode
from bench.reports.suite_repeat import (
    CONTROL_PAIR,
    add_round_regret,
    compare_pair,
    geomean,
    median_rows,
    paired_rows,
    write_repeated,
)

CONTROL = control_label("round_robin")


def test_control_label_runs_the_mode_it_repeats() -> None:
    assert CONTROL != "round_robin"
    assert routing_mode(CONTROL) == "round_robin"
    assert routing_mode("probe") == "probe"


def test_rounds_alternate_the_order_so_each_pair_runs_both_ways() -> None:
    order = ["oracle", "probe", "prefix_tree", "round_robin"]
    assert round_order(order, 1) == order
    assert round_order(order, 2) == ["oracle", "round_robin", "prefix_tree", "probe"]
    assert round_order(order, 3) == order
    first, second = round_order(order, 1), round_order(order, 2)
    for a, b in itertools.combinations(order[1:], 2):
        assert (first.index(a) < first.index(b)) != (second.index(a) < second.index(b))


def test_control_runs_at_the_opposite_end_from_its_mode() -> None:
    order = ["oracle", "probe", "prefix_tree", "round_robin"]
    # round_robin runs last in round 1: its control first (after the oracle, which runs nothing).
    assert round_order(order, 1, "round_robin") == ["oracle", CONTROL, "probe", "prefix_tree", "round_robin"]
    assert round_order(order, 2, "round_robin") == ["oracle", "round_robin", "prefix_tree", "probe", CONTROL]
    assert round_order(["probe", "round_robin"], 1, "probe") == ["probe", "round_robin", control_label("probe")]


def _row(
    rnd: int, mode: str, p50: float | None, p99: float | None, goodput: float | None, **more: Any
) -> dict[str, Any]:
    return {
        "workload": "w",
        "round": rnd,
        "mode": mode,
        "ttft_p50_ms": p50,
        "ttft_p99_ms": p99,
        "goodput_fraction": goodput,
        **more,
    }


def _three_rounds() -> list[dict[str, Any]]:
    return [
        _row(1, "oracle", None, None, None),  # the bound runs nothing: no latency
        _row(1, "probe", 50.0, 400.0, 0.90, itl_p99_ms=20.0, hit_ratio=0.6, share_pd=0.1),
        _row(1, "round_robin", 100.0, 800.0, 0.85, itl_p99_ms=30.0, hit_ratio=0.2, share_pd=0.0),
        _row(1, CONTROL, 110.0, 880.0, 0.80),
        _row(2, "probe", 60.0, 600.0, 0.80, itl_p99_ms=10.0, hit_ratio=0.8, share_pd=0.3),
        _row(2, "round_robin", 60.0, 300.0, 0.80, itl_p99_ms=50.0, hit_ratio=0.1, share_pd=0.0),
        _row(2, CONTROL, 50.0, 300.0, 0.85),
        _row(3, "probe", 90.0, 900.0, 0.70, itl_p99_ms=40.0, hit_ratio=0.7, share_pd=0.2),
        _row(3, "round_robin", 60.0, 450.0, 0.75, itl_p99_ms=40.0, hit_ratio=0.3, share_pd=0.0),
        _row(3, CONTROL, 66.0, 450.0, 0.75),
    ]


def test_geometric_mean() -> None:
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([0.5, 2.0]) == pytest.approx(1.0)
    assert geomean([]) is None


def test_paired_ratios_against_the_reference_per_round() -> None:
    pairs = {p["pair"]: p for p in paired_rows(_three_rounds(), "probe", "round_robin")}
    assert list(pairs) == ["probe vs round_robin", CONTROL_PAIR]  # no oracle, the control only as A/A
    p = pairs["probe vs round_robin"]
    assert (p["a"], p["b"]) == ("probe", "round_robin")
    # p50 ratios probe / round_robin per round: 50/100, 60/60, 90/60.
    p50 = p["ttft_p50_ratio"]
    assert p50["gmean"] == pytest.approx((0.5 * 1.0 * 1.5) ** (1 / 3), abs=1e-4)
    assert (p50["min"], p50["max"]) == (0.5, 1.5)
    assert (p50["no_worse"], p50["rounds"]) == (2, 3)  # a tie counts as no worse
    # p99: 400/800, 600/300, 900/450.
    p99 = p["ttft_p99_ratio"]
    assert p99["gmean"] == pytest.approx((0.5 * 2.0 * 2.0) ** (1 / 3), abs=1e-4)
    assert (p99["min"], p99["max"], p99["no_worse"]) == (0.5, 2.0, 1)
    # goodput probe - round_robin: +0.05, 0, -0.05.
    g = p["goodput_diff"]
    assert g["median"] == pytest.approx(0.0, abs=1e-9)
    assert (g["min"], g["max"]) == (pytest.approx(-0.05), pytest.approx(0.05))
    assert (g["no_worse"], g["rounds"]) == (2, 3)


def test_control_row_is_the_control_against_its_mode() -> None:
    aa = next(p for p in paired_rows(_three_rounds(), "probe", "round_robin") if p["pair"] == CONTROL_PAIR)
    assert (aa["a"], aa["b"]) == (CONTROL, "round_robin")
    # p50 control / round_robin: 110/100, 50/60, 66/60.
    p50 = aa["ttft_p50_ratio"]
    assert p50["gmean"] == pytest.approx((1.1 * (50 / 60) * 1.1) ** (1 / 3), abs=1e-4)
    assert (p50["min"], p50["max"], p50["no_worse"]) == (pytest.approx(50 / 60, abs=1e-4), 1.1, 1)
    assert aa["ttft_p99_ratio"]["no_worse"] == 2  # 880/800 worse, 300/300 and 450/450 ties
    g = aa["goodput_diff"]  # -0.05, +0.05, 0
    assert (g["min"], g["max"], g["no_worse"]) == (pytest.approx(-0.05), pytest.approx(0.05), 2)
    # Without a control there is no A/A row.
    assert [p["pair"] for p in paired_rows(_three_rounds(), "probe", None)] == ["probe vs round_robin"]


def test_a_failed_round_is_left_out_of_its_pairs() -> None:
    rows = _three_rounds()
    rows[5] = {"workload": "w", "round": 2, "mode": "round_robin", "failed": "ExitedBeforeReady: gone"}
    p = paired_rows(rows, "probe", "round_robin")
    vs, aa = p[0], p[1]
    assert vs["ttft_p50_ratio"]["rounds"] == 2
    assert vs["ttft_p50_ratio"]["gmean"] == pytest.approx(math.sqrt(0.5 * 1.5), abs=1e-4)
    assert aa["goodput_diff"]["rounds"] == 2


def test_a_mode_failed_in_every_round_keeps_its_row_with_no_rounds() -> None:
    rows = [r for r in _three_rounds() if r["mode"] != "round_robin"]
    rows += [{"workload": "w", "round": k, "mode": "round_robin", "failed": "RuntimeError: boom"} for k in (1, 2, 3)]
    vs, aa = paired_rows(rows, "probe", "round_robin")
    assert (vs["pair"], aa["pair"]) == ("probe vs round_robin", CONTROL_PAIR)
    assert vs["ttft_p50_ratio"]["rounds"] == aa["goodput_diff"]["rounds"] == 0
    assert vs["ttft_p50_ratio"]["gmean"] is None


def test_compare_pair_of_modes_without_common_rounds() -> None:
    got = compare_pair({1: {"ttft_p50_ms": 5.0}}, {2: {"ttft_p50_ms": 5.0}})
    assert got["ttft_p50_ratio"] == {"gmean": None, "min": None, "max": None, "no_worse": 0, "rounds": 0}
    assert got["goodput_diff"]["median"] is None


def test_median_columns_over_measured_rounds() -> None:
    rows = _three_rounds()
    rows[7] = {"workload": "w", "round": 3, "mode": "probe", "failed": "RuntimeError: boom"}
    med = {r["mode"]: r for r in median_rows(rows)}
    assert list(med) == ["oracle", "probe", "round_robin", CONTROL]
    probe, rr = med["probe"], med["round_robin"]
    assert probe["rounds"] == "2/3"
    assert probe["ttft_p50_ms"] == pytest.approx(55.0)  # 50, 60 (round 3 failed)
    assert probe["ttft_p99_ms"] == pytest.approx(500.0)
    assert probe["itl_p99_ms"] == pytest.approx(15.0)
    assert probe["hit_ratio"] == pytest.approx(0.7)
    assert probe["share_pd"] == pytest.approx(0.2)
    assert rr["rounds"] == "3/3"
    assert rr["ttft_p50_ms"] == 60.0
    assert rr["ttft_p99_ms"] == 450.0
    assert rr["goodput_fraction"] == pytest.approx(0.8)
    assert rr["itl_p99_ms"] == 40.0
    assert med["oracle"]["ttft_p50_ms"] is None


def test_round_regret_keeps_the_control_apart_from_its_mode() -> None:
    rows = add_round_regret(_three_rounds())
    r1 = {r["mode"]: r for r in rows if r["round"] == 1}
    assert r1["probe"]["regret_p50"] == pytest.approx(50 / 100)  # against round_robin, not the control
    assert r1["round_robin"]["regret_p50"] == pytest.approx(100 / 50)
    assert r1[CONTROL]["regret_p50"] == pytest.approx(110 / 50)  # against probe only
    assert r1["oracle"]["regret_p50"] is None


def test_write_repeated_tables(tmp_path: Path) -> None:
    config = {"workloads": ["w"], "repeat": 3, "control": "round_robin", "reference": "probe"}
    written = write_repeated(tmp_path, _three_rounds(), {"w": None}, config)
    assert tmp_path / "suite.md" in written
    md = (tmp_path / "suite.md").read_text()
    assert "| w | probe vs round_robin | 0.91 | 0.50-1.50 | 2/3 |" in md
    assert f"| w | {CONTROL_PAIR} |" in md
    assert "outside the control's min-max" in md
    data = json.loads((tmp_path / "suite.json").read_text())
    assert [r["round"] for r in data["rows"] if r["mode"] == "probe"] == [1, 2, 3]
    assert data["aggregate"]["reference"] == "probe"
    assert [m["mode"] for m in data["aggregate"]["medians"]] == ["oracle", "probe", "round_robin", CONTROL]
    assert data["config"]["repeat"] == 3


def _args(repeat: int, control: str | None = None, reference: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(repeat=repeat, control=control, reference=reference)


def test_suite_options() -> None:
    modes = ["oracle", "round_robin", "probe"]
    assert suite_options(_args(1), modes) == (1, None, None)
    assert suite_options(_args(3), modes) == (3, None, "probe")
    assert suite_options(_args(2), ["oracle", "round_robin", "least_loaded"]) == (2, None, "round_robin")
    assert suite_options(_args(2, "round_robin", "round_robin"), modes) == (2, "round_robin", "round_robin")
    with pytest.raises(SystemExit, match="need --repeat 2"):
        suite_options(_args(1, "probe"), modes)
    with pytest.raises(SystemExit, match="--control oracle"):
        suite_options(_args(2, "oracle"), modes)
    with pytest.raises(SystemExit, match="--reference least_loaded"):
        suite_options(_args(2, None, "least_loaded"), modes)
    with pytest.raises(SystemExit, match="--repeat"):
        suite_options(_args(0), modes)
