"""Router replicas, engine restarts and an engine slowed mid-run in the bench
(bench/fleet.py, bench/harness/replicas.py), end to end on a tiny scale, and the recovery
figure on hand-made rows."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench.cli import build_parser
from bench.experiments.options import run_spec_from_args
from bench.experiments.replay import run_replay
from bench.harness.loadgen import _rotation
from bench.harness.replicas import recovery
from bench.reports.fleet_table import fleet_rows, recovered_after, recovery_rows, targets, write_tables
from bench.reports.rundir import load_requests

TINY = [
    "--workload",
    "prefix-groups",
    "--groups",
    "2",
    "--per-group",
    "12",
    "--system-tokens",
    "128",
    "--question-tokens",
    "16",
    "--output-tokens",
    "8",
    "--rate",
    "12",
    "--speed",
    "20",
    "--engines",
    "2",
    "--prefill",
    "0",
]


def test_requests_rotate_over_replicas() -> None:
    nxt = _rotation(["a", "b", "c"])
    assert [nxt() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    one = _rotation("u")
    assert [one(), one()] == ["u", "u"]


def test_recovery_windows() -> None:
    def row(t: float, cached: int, route: str = "probe_hit") -> dict[str, Any]:
        return {"start_s": t, "status": 200, "expected_prompt_tokens": 100, "cached_tokens": cached, "route": route}

    rows = [row(i * 0.1, 80) for i in range(10)]
    rows += [row(1.0 + i * 0.1, 0 if i < 2 else 90) for i in range(6)]
    rows += [row(2.0, 100, route="pd"), {"start_s": 2.1, "status": 500}]
    r = recovery(rows, 1.0, window=3)
    assert r["before_100"] == 0.8
    # After: (0+0+90)/300, (90+90+90)/300, and the pd request counts as computed (0 of 100).
    assert r["after"] == [0.3, 0.9, 0.0]


def test_two_replicas_of_our_router_and_an_engine_restart(tmp_path: Path) -> None:
    a = build_parser().parse_args(
        ["replay", *TINY, "--routers", "2", "--restart-engine-at", "1.0", "--out", str(tmp_path)]
    )
    assert (a.routers, a.restart_engine_at) == (2, 1.0)
    s = asyncio.run(run_replay(run_spec_from_args(a, "probe", tmp_path / "probe")))
    assert (s["routers"], s["requests"], s["errors"]) == (2, 24, 0), s.get("error_examples")
    # Both replicas served: each wrote per-request log lines that the summary read.
    logs = sorted(p.name for p in (tmp_path / "probe" / "logs").glob("router*.log"))
    assert logs == ["router-1.log", "router.log"]
    for name in logs:
        assert "cachehit_router.requests" in (tmp_path / "probe" / "logs" / name).read_text()
    rows = load_requests(tmp_path / "probe")
    assert all(r.get("route") for r in rows)  # every answer matched to a replica's log line
    assert s["restart"]["down_at_s"] == pytest.approx(1.0, abs=0.5)
    assert s["recovery"]["after"]
    assert s["recovery"]["before_100"] is not None
    assert (tmp_path / "probe" / "logs" / "sim-consumer-0-restarted.log").exists()


def test_an_engine_slowed_mid_run_takes_the_slowdown(tmp_path: Path) -> None:
    a = build_parser().parse_args(
        ["replay", *TINY, "--slow-engine-at", "0.5", "--slowdown", "3", "--out", str(tmp_path)]
    )
    s = asyncio.run(run_replay(run_spec_from_args(a, "round_robin", tmp_path / "rr")))
    assert (s["requests"], s["errors"]) == (24, 0), s.get("error_examples")
    # The first decoder's faults route answered with the slowdown it now runs at.
    assert s["slowdown"]["slowdown"] == 3.0
    assert s["slowdown"]["slowed_at_s"] == 0.5


def _summary(hit: float, p50: float, p99: float, **kw: Any) -> dict[str, Any]:
    return {"hit_ratio": hit, "ttft_p50_ms": p50, "ttft_p99_ms": p99, "requests": 40, "errors": 0, **kw}


def test_fleet_table_compares_each_mode_with_its_own_single_router(tmp_path: Path) -> None:
    summaries = {
        ("prefix-groups", "probe", 1): _summary(0.80, 100, 400),
        ("prefix-groups", "probe", 4): _summary(0.78, 110, 420),  # -2.5 %: within 3 %
        ("prefix-groups", "prefix_tree", 1): _summary(0.80, 90, 380),
        ("prefix-groups", "prefix_tree", 4): _summary(0.50, 150, 900),
        ("multiturn", "probe", 1): _summary(0.60, 50, 200),
        ("multiturn", "probe", 4): _summary(0.50, 60, 210),  # -16.7 %: missed
        ("multiturn", "prefix_tree", 4): _summary(0.55, 40, 300),
    }
    rows = fleet_rows(summaries)
    by = {(r["workload"], r["mode"], r["routers"]): r for r in rows}
    assert by[("prefix-groups", "probe", 4)]["hit_vs_1_pct"] == -2.5
    assert by[("prefix-groups", "prefix_tree", 4)]["hit_vs_1_pct"] == -37.5
    assert by[("multiturn", "prefix_tree", 4)]["hit_vs_1_pct"] is None  # no N = 1 run to compare
    checks = {(c["workload"], c["check"]): c for c in targets(rows)}
    assert checks[("prefix-groups", "probe hit ratio at N=4 vs N=1")]["met"] is True
    assert checks[("multiturn", "probe hit ratio at N=4 vs N=1")]["met"] is False
    assert checks[("prefix-groups", "probe ttft_p50 < prefix_tree")]["met"] is True
    assert checks[("multiturn", "probe ttft_p50 < prefix_tree")]["met"] is False  # 60 vs 40
    assert checks[("multiturn", "probe ttft_p99 < prefix_tree")]["met"] is True
    assert checks[("prefix-groups", "probe ttft_p50 < smg_cache_aware")]["met"] is None  # not measured
    text = write_tables(tmp_path, rows, targets(rows), [])
    assert "| prefix-groups | probe | 4 |" in text
    assert (tmp_path / "fleet.json").exists()


def test_recovery_counts_requests_until_the_hit_ratio_is_back() -> None:
    assert recovered_after({"before_100": 0.8, "window": 25, "after": [0.1, 0.5, 0.79, 0.8]}) == 75
    assert recovered_after({"before_100": 0.8, "window": 25, "after": [0.1, None, 0.2]}) is None
    assert recovered_after({"before_100": None, "window": 25, "after": [0.9]}) is None
    rows = recovery_rows(
        {
            ("trace", "probe"): {
                "routers": 4,
                "errors": 0,
                "recovery": {"before_100": 0.6, "window": 25, "after": [0.2, 0.3, 0.4, 0.5, 0.59]},
            }
        }
    )
    assert rows[0]["recovered_after"] == 125
    assert rows[0]["within_100"] is False
    assert rows[0]["after"] == "0.20 0.30 0.40 0.50 0.59"
    # A run that ended before any window after the restart says nothing about recovery.
    ended = recovery_rows({("multiturn", "probe"): {"recovery": {"before_100": 0.5, "window": 25, "after": []}}})
    assert ended[0]["within_100"] is None


def test_smg_replicas(tmp_path: Path) -> None:
    # sglang-router comes with the bench extra, which the test command installs.
    a = build_parser().parse_args(["replay", *TINY, "--routers", "2", "--out", str(tmp_path)])
    s = asyncio.run(run_replay(run_spec_from_args(a, "smg_cache_aware", tmp_path / "smg")))
    assert (s["routers"], s["errors"]) == (2, 0), s.get("error_examples")
