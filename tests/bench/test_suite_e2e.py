"""`python -m bench suite --quick` end to end on a tiny configuration: one short workload, two
modes on real simulated engines and the real router; the table and its regret are consistent.
With `--repeat 2 --control`: a directory per round and mode, the rounds' rows, the A/A row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main

# One short workload on two small engines: what an end-to-end run of the suite needs.
TINY = ["--workloads", "hetero", "--requests", "16", "--engines", "2", "--speed", "1"]


def test_suite_quick_tiny_table_and_regret(tmp_path: Path) -> None:
    rc = main(["suite", "--quick", "--out", str(tmp_path), "--modes", "oracle,probe,round_robin", *TINY])
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


def test_suite_repeat_rounds_with_an_aa_control(tmp_path: Path) -> None:
    rc = main(
        [
            "suite",
            "--out",
            str(tmp_path),
            "--modes",
            "probe,round_robin",
            *TINY,
            "--repeat",
            "2",
            "--control",
            "round_robin",
        ]
    )
    assert rc == 0
    labels = ["probe", "round_robin", "round_robin~control"]
    for k in (1, 2):
        for label in labels:
            assert (tmp_path / "hetero" / f"r{k}" / label / "requests.jsonl").exists()
    data = json.loads((tmp_path / "suite.json").read_text())
    assert [(r["round"], r["mode"]) for r in data["rows"]] == [(k, m) for k in (1, 2) for m in labels]
    for r in data["rows"]:
        assert r["requests"] == 16
        assert r["errors"] == 0
    # The control ran round_robin's routing: every request went direct, as round_robin's did.
    control = next(r for r in data["rows"] if r["mode"] == "round_robin~control")
    assert control["share_direct"] == 1.0
    summary = json.loads((tmp_path / "hetero" / "r1" / "round_robin~control" / "summary.json").read_text())
    assert (summary["mode"], summary["label"]) == ("round_robin", "round_robin~control")
    assert summary["router_options"]["strategy"] == "round_robin"
    assert data["config"]["reference"] == "probe"
    pairs = {p["pair"]: p for p in data["aggregate"]["paired"]}
    assert set(pairs) == {"probe vs round_robin", "A/A control"}
    assert pairs["A/A control"]["ttft_p50_ratio"]["rounds"] == 2
    md = (tmp_path / "suite.md").read_text()
    assert "| hetero | A/A control |" in md
    assert "| hetero | round_robin~control | 2/2 |" in md
