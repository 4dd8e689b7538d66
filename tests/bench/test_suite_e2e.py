"""`python -m bench suite --quick` end to end on a tiny configuration: one short workload, two
modes on real simulated engines and the real router; the table and its regret are consistent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main


def test_suite_quick_tiny_table_and_regret(tmp_path: Path) -> None:
    rc = main(
        [
            "suite",
            "--quick",
            "--out",
            str(tmp_path),
            "--workloads",
            "hetero",
            "--modes",
            "oracle,probe,round_robin",
            "--requests",
            "16",
            "--engines",
            "2",
            "--speed",
            "1",
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "suite.json").read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows) == ["oracle", "probe", "round_robin"]
    load = data["loads"]["hetero"]
    assert load["utilisation"] == pytest.approx(0.85, rel=1e-6)
    assert load["engines"] == 2
    for mode in ("probe", "round_robin"):
        r = rows[mode]
        assert r["requests"] == 16
        assert r["errors"] == 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert r["hit_ratio"] is not None
        assert r["oracle_hit_ratio"] == rows["oracle"]["oracle_hit_ratio"]
        shares = [r[f"share_{x}"] for x in ("probe_hit", "pd", "direct")]
        assert sum(shares) == pytest.approx(1.0)
    # Two modes ran (the oracle runs nothing): each one's regret is against the other.
    rr, probe = rows["round_robin"], rows["probe"]
    for q in ("p50", "p99"):
        assert rr[f"regret_{q}"] == pytest.approx(rr[f"ttft_{q}_ms"] / probe[f"ttft_{q}_ms"], rel=1e-3)
        assert probe[f"regret_{q}"] == pytest.approx(probe[f"ttft_{q}_ms"] / rr[f"ttft_{q}_ms"], rel=1e-3)
    assert rows["round_robin"]["share_direct"] == 1.0  # a direct strategy never probes
    assert rows["oracle"]["regret_p50"] is None
    md = (tmp_path / "suite.md").read_text()
    assert "utilisation 0.85 of K=2" in md
    assert "| hetero | probe |" in md
    assert (tmp_path / "regret.png").stat().st_size > 1000
    assert (tmp_path / "hetero" / "probe" / "requests.jsonl").exists()


def test_suite_rejects_unknown_workloads_and_modes(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown workload nope"):
        main(["suite", "--out", str(tmp_path), "--workloads", "nope"])
    with pytest.raises(SystemExit, match="unknown mode"):
        main(["suite", "--out", str(tmp_path), "--workloads", "hetero", "--modes", "probe,nope"])
