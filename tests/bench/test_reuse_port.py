"""`python -m bench reuse-port` on a tiny scale: N routers on one port all take connections."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from bench.experiments import reuse_port
from bench.harness.cluster import RouterOptions, router_toml


def test_extra_server_keys_reach_the_server_table() -> None:
    toml = router_toml(8000, ["http://127.0.0.1:1"], [], RouterOptions(extra_server={"reuse_port": True}))
    assert tomllib.loads(toml.split("\n", 1)[1])["server"]["reuse_port"] is True


def test_two_processes_share_the_port_and_the_work(tmp_path: Path) -> None:
    # 16 connections: the kernel's hash leaves one process with at most one of them about
    # once in 2,000 runs.
    argv = ["--processes", "1,2", "--connections", "16", "--seconds", "1.5", "--out", str(tmp_path)]
    assert reuse_port.main(argv) == 0
    rows = json.loads((tmp_path / "reuse_port.json").read_text())["rows"]
    assert [r["processes"] for r in rows] == [1, 2]
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in rows)
    shares = [float(s) for s in rows[1]["cpu_share"].split(" / ")]
    assert len(shares) == 2
    assert min(shares) > 0.05
    assert (tmp_path / "reuse_port.md").read_text().startswith("|")
