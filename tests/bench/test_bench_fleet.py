"""Router replicas and engine restarts in the bench (bench/fleet.py), end to end on a tiny
scale, and the recovery figure on hand-made rows."""
from __future__ import annotations

import asyncio
import shutil

import pytest

from bench.__main__ import build_parser, run_spec_from_args
from bench.fleet import recovery
from bench.loadgen import _rotation
from bench.replay import load_requests, run_replay

TINY = ["--workload", "prefix-groups", "--groups", "2", "--per-group", "12", "--system-tokens", "128",
        "--question-tokens", "16", "--output-tokens", "8", "--rate", "12", "--speed", "20",
        "--engines", "2", "--prefill", "0"]


def test_requests_rotate_over_replicas():
    nxt = _rotation(["a", "b", "c"])
    assert [nxt() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    one = _rotation("u")
    assert [one(), one()] == ["u", "u"]


def test_recovery_windows():
    def row(t, cached, route="probe_hit"):
        return {"start_s": t, "status": 200, "expected_prompt_tokens": 100, "cached_tokens": cached, "route": route}
    rows = [row(i * 0.1, 80) for i in range(10)]
    rows += [row(1.0 + i * 0.1, 0 if i < 2 else 90) for i in range(6)]
    rows += [row(2.0, 100, route="pd"), {"start_s": 2.1, "status": 500}]
    r = recovery(rows, 1.0, window=3)
    assert r["before_100"] == 0.8
    # After: (0+0+90)/300, (90+90+90)/300, and the pd request counts as computed (0 of 100).
    assert r["after"] == [0.3, 0.9, 0.0]


def test_two_replicas_of_our_router_and_an_engine_restart(tmp_path):
    a = build_parser().parse_args(["replay", *TINY, "--routers", "2", "--restart-engine-at", "1.0",
                                   "--out", str(tmp_path)])
    assert (a.routers, a.restart_engine_at) == (2, 1.0)
    s = asyncio.run(run_replay(run_spec_from_args(a, "probe", tmp_path / "probe")))
    assert s["routers"] == 2 and s["requests"] == 24 and s["errors"] == 0, s.get("error_examples")
    # Both replicas served: each wrote per-request log lines that the summary read.
    logs = sorted(p.name for p in (tmp_path / "probe" / "logs").glob("router*.log"))
    assert logs == ["router-1.log", "router.log"]
    for name in logs:
        assert "cachehit_router.requests" in (tmp_path / "probe" / "logs" / name).read_text()
    rows = load_requests(tmp_path / "probe")
    assert all(r.get("route") for r in rows)  # every answer matched to a replica's log line
    assert s["restart"]["down_at_s"] == pytest.approx(1.0, abs=0.5)
    assert s["recovery"]["after"] and s["recovery"]["before_100"] is not None
    assert (tmp_path / "probe" / "logs" / "sim-consumer-0-restarted.log").exists()


@pytest.mark.skipif(not shutil.which("smg"), reason="sglang-router (smg) is a bench baseline, not a test dependency")
def test_smg_replicas(tmp_path):
    a = build_parser().parse_args(["replay", *TINY, "--routers", "2", "--out", str(tmp_path)])
    s = asyncio.run(run_replay(run_spec_from_args(a, "smg_cache_aware", tmp_path / "smg")))
    assert s["routers"] == 2 and s["errors"] == 0, s.get("error_examples")
