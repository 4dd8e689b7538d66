"""The suite table's arithmetic: regret against the best baseline, the cost model's accuracy,
route shares, and the predicted TTFT carried into requests.jsonl."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from bench.harness.loadgen import Result
from bench.reports.rundir import load_requests, parse_router_log, write_outputs
from bench.reports.suite_report import add_regret, load_line, model_accuracy, route_shares, suite_row, write_suite
from bench.workloads import generators as wl


def _row(workload: str, mode: str, p50: float | None, p99: float | None) -> dict[str, Any]:
    return {"workload": workload, "mode": mode, "ttft_p50_ms": p50, "ttft_p99_ms": p99}


def test_regret_divides_by_the_best_other_mode_of_the_same_workload() -> None:
    rows = [
        _row("a", "probe", 40.0, 900.0),
        _row("a", "round_robin", 100.0, 600.0),
        _row("a", "least_loaded", 80.0, 1200.0),
        _row("a", "prefix_tree", 120.0, 300.0),
        _row("b", "probe", 50.0, 50.0),
        _row("b", "round_robin", 25.0, 100.0),
        _row("c", "probe", 10.0, 20.0),  # no other mode ran: no regret
        _row("c", "oracle", 1.0, 1.0),  # the bound runs nothing: neither judged nor a yardstick
        _row("b", "least_loaded", None, None),
    ]  # a run without TTFT
    add_regret(rows)
    got = {(r["workload"], r["mode"]): (r["regret_p50"], r["regret_p99"]) for r in rows}
    assert got[("a", "probe")] == (0.5, 3.0)  # 40 / 80, 900 / 300
    assert got[("a", "round_robin")] == (2.5, 2.0)  # 100 / 40, 600 / 300
    assert got[("a", "least_loaded")] == (2.0, 4.0)
    assert got[("a", "prefix_tree")] == (3.0, 0.5)  # 300 / 600: it beat every other mode
    assert got[("b", "probe")] == (2.0, 0.5)
    assert got[("b", "round_robin")] == (0.5, 2.0)
    assert got[("c", "probe")] == (None, None)
    assert got[("c", "oracle")] == (None, None)
    assert got[("b", "least_loaded")] == (None, None)
    # In each workload and quantile one mode, the best, is below 1: the others' regret is
    # what they lose to it.
    for w in ("a", "b"):
        for q in ("p50", "p99"):
            below = [r["mode"] for r in rows if r["workload"] == w and (r["regret_" + q] or 9) < 1]
            assert len(below) == 1


def test_model_accuracy_medians_of_absolute_signed_and_relative_error() -> None:
    rows: list[dict[str, Any]] = [
        {"predicted_ttft_ms": 110.0, "router_ttft_ms": 100.0},  # +10, 0.1
        {"predicted_ttft_ms": 150.0, "router_ttft_ms": 200.0},  # -50, 0.25
        {"predicted_ttft_ms": 45.0, "router_ttft_ms": 50.0},  # -5, 0.1
        {"predicted_ttft_ms": 400.0, "router_ttft_ms": 100.0},  # +300, 3.0
        {"predicted_ttft_ms": None, "router_ttft_ms": 80.0},  # no prediction: left out
        {"router_ttft_ms": 70.0},
        {"predicted_ttft_ms": 20.0, "router_ttft_ms": None},
    ]  # failed before a first token
    acc = model_accuracy(rows)
    assert acc["pred_requests"] == 4
    assert acc["pred_abs_err_p50_ms"] == pytest.approx((10 + 50) / 2)  # |e| = 5, 10, 50, 300
    assert acc["pred_bias_p50_ms"] == pytest.approx((-5 + 10) / 2)  # e = -50, -5, 10, 300
    assert acc["pred_rel_err_p50"] == pytest.approx((0.1 + 0.25) / 2)  # 0.1, 0.1, 0.25, 3.0
    assert acc["pred_engine_ratio"] is None  # no engine named
    none = model_accuracy([{"router_ttft_ms": 5.0, "ttft_ms": 6.0}])
    assert none["pred_requests"] == 0
    assert none["pred_abs_err_p50_ms"] is None
    assert none["pred_engine_ratio"] is None


def test_model_accuracy_shows_the_engine_predicted_furthest_from_its_times() -> None:
    # d0 is predicted at half its times, d1 right; d2 served too few requests to judge.
    rows: list[dict[str, Any]] = [{"predicted_ttft_ms": 50.0, "router_ttft_ms": 100.0, "winner": "d0"}] * 5
    rows += [{"predicted_ttft_ms": 100.0, "router_ttft_ms": 100.0, "winner": "d1"}] * 6
    rows += [{"predicted_ttft_ms": 900.0, "router_ttft_ms": 100.0, "winner": "d2"}] * 4
    assert model_accuracy(rows)["pred_engine_ratio"] == "0.50-1.00"


def test_route_shares_and_rows() -> None:
    assert route_shares({"probe_hit": 6, "pd": 3, "direct": 1}) == {
        "share_probe_hit": 0.6,
        "share_pd": 0.3,
        "share_direct": 0.1,
    }
    assert route_shares({}) == {"share_probe_hit": None, "share_pd": None, "share_direct": None}
    s = {
        "mode": "probe",
        "requests": 3,
        "errors": 0,
        "hit_ratio": 0.5,
        "oracle_hit_ratio": 0.6,
        "ttft_p50_ms": 10.0,
        "ttft_p99_ms": 30.0,
        "routes": {"probe_hit": 2, "pd": 1},
    }
    row = suite_row("w", s, [{"predicted_ttft_ms": 12.0, "router_ttft_ms": 10.0}])
    assert row["share_probe_hit"] == pytest.approx(2 / 3)
    assert row["share_direct"] == 0.0
    assert row["pred_abs_err_p50_ms"] == 2.0
    assert row["hit_ratio"] == 0.5
    oracle = suite_row("w", {"mode": "oracle", "hit_ratio": 0.6, "oracle_hit_ratio": 0.6}, [])
    assert oracle["share_pd"] is None
    assert oracle["pred_requests"] == 0


def test_table_shows_a_dash_without_predictions(tmp_path: Path) -> None:
    rows = add_regret(
        [
            {**_row("w", "round_robin", 10.0, 20.0), "requests": 5, "errors": 0, **model_accuracy([])},
            {**_row("w", "prefix_tree", 10.0, 20.0), "requests": 5, "errors": 0, **model_accuracy([])},
        ]
    )
    write_suite(tmp_path, rows, {"w": None}, {"modes": ["round_robin", "prefix_tree"]})
    md = (tmp_path / "suite.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| w |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "round_robin"
    assert cells[8:10] == ["1.00", "1.00"]
    assert cells[-3:] == ["-", "-", "-"]
    assert "closed loop" in md
    assert json.loads((tmp_path / "suite.json").read_text())["rows"][0]["regret_p50"] == 1.0


def test_predicted_ttft_is_carried_from_the_router_log_into_requests_jsonl(tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    lines = [
        {
            "request_id": "cmpl-1",
            "route": "probe_hit",
            "ttft_ms": 42.0,
            "predicted_ttft_ms": 40.5,
            "scratch_ttft_ms": 300.0,
        },
        {"request_id": "cmpl-2", "route": "direct", "ttft_ms": 13.0},
    ]
    log.write_text("".join(f"2026-01-01 INFO cachehit_router.requests: {json.dumps(d)}\n" for d in lines))
    logs = parse_router_log(log)
    results = [
        Result(index=0, status=200, response_id="cmpl-1", ttft_ms=45.0),
        Result(index=1, status=200, response_id="cmpl-2", ttft_ms=15.0),
    ]
    write_outputs(tmp_path, {"mode": "probe"}, results, logs)
    rows = load_requests(tmp_path)
    assert [r["predicted_ttft_ms"] for r in rows] == [40.5, None]
    assert [r["router_ttft_ms"] for r in rows] == [42.0, 13.0]
    assert [r["scratch_ttft_ms"] for r in rows] == [300.0, None]
    assert model_accuracy(rows)["pred_abs_err_p50_ms"] == 1.5


def test_on_off_arrivals_keep_the_mean_rate_in_bursts() -> None:
    t = wl.on_off_arrivals(4000, 10.0, on_s=2.0, off_s=6.0, seed=1)
    assert t == sorted(t)
    assert t == wl.on_off_arrivals(4000, 10.0, 2.0, 6.0, seed=1)
    assert 9.0 < len(t) / t[-1] < 11.0
    # Nothing arrives in the silent part of a period.
    assert all((x % 8.0) < 2.0 for x in t)
    with pytest.raises(ValueError, match="mean_rate > 0"):
        wl.on_off_arrivals(3, 0.0, 1.0, 1.0)


def test_heterogeneous_prompts_span_their_range_with_little_reuse() -> None:
    reqs = wl.heterogeneous_requests(n=300, min_tokens=32, max_tokens=8000, output_tokens=16, rate=5.0, seed=2)
    lengths = [r.prompt_tokens for r in reqs]
    assert min(lengths) >= 32
    assert max(lengths) <= 8000
    assert min(lengths) < 64
    assert max(lengths) > 4000
    assert sum(x < 506 for x in lengths) / len(lengths) == pytest.approx(0.5, abs=0.1)  # median ~ sqrt(32*8000)
    for r in reqs[:20]:
        assert wl.token_count(r.prompt) == r.prompt_tokens
        assert r.max_tokens == 16
    assert wl.oracle_for_requests(reqs[:60], 16)["oracle_hit_ratio"] < 0.01
    assert [r.prompt for r in reqs[:5]] == [
        r.prompt
        for r in wl.heterogeneous_requests(n=5, min_tokens=32, max_tokens=8000, output_tokens=16, rate=5.0, seed=2)
    ]


def test_gamma_arrivals_keep_the_mean_rate_and_cluster_as_asked() -> None:
    t = wl.gamma_arrivals(20_000, 5.0, cv=3.0, seed=2)
    gaps = [b - a for a, b in itertools.pairwise(t)]
    mean = sum(gaps) / len(gaps)
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert abs(mean - 0.2) < 0.02
    assert 2.5 < sd / mean < 3.5
    assert t == wl.gamma_arrivals(20_000, 5.0, 3.0, seed=2)


def test_compare_rows_judge_each_run_against_the_best_other_of_its_load(tmp_path: Path) -> None:
    from bench.reports.render import compare_rows

    runs = {"a": (100.0, 0.5, 2.0), "b": (200.0, 0.7, 2.0), "c": (50.0, 0.1, 4.0)}
    for name, (ttft, good, rate) in runs.items():
        (tmp_path / name).mkdir()
        summary = {"mode": name, "ttft_p50_ms": ttft, "goodput_fraction": good, "offered_rps": rate}
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    rows = {r["label"]: r for r in compare_rows([tmp_path / n for n in runs])}
    assert rows["a"]["regret_p50"] == 0.5
    assert rows["b"]["regret_p50"] == 2.0
    assert rows["a"]["goodput_gap"] == pytest.approx(-0.2)
    assert rows["c"]["regret_p50"] is None  # alone at its load


def test_load_line_says_what_the_producers_cannot_take() -> None:
    load = {
        "requests": 400,
        "span_s": 83.0,
        "offered_rps": 4.81,
        "utilisation": 0.85,
        "engines": 4,
        "speed": 0.3,
        "utilisation_oracle": 0.63,
        "pd_prefill_utilisation": 3.3,
        "pd_prefill_utilisation_oracle": 2.5,
        "decoder_prefill_share": 0.6,
    }
    line = load_line("low-reuse", load)
    assert "P/D prefill engines 3.30 if every request fell back (2.50 with the oracle's hits" in line
    assert "decoders compute at least 60% of the prompt work" in line
    closed = load_line("multiturn", None)
    assert closed.startswith("multiturn: closed loop")
