"""vLLM's own benchmark client (`vllm bench serve` through its module) against the router
on simulated engines and against one engine directly (bench/vllm_client.py), tiny scale."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench.experiments import vllm_client
from support.requirements import real_engine_required


def test_vllm_bench_serve_through_the_router_and_direct(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if importlib.util.find_spec("vllm") is None:
        # CI installs vLLM (CACHEHIT_REQUIRE_REAL_ENGINE=1): there a missing one is a failure.
        if real_engine_required():
            pytest.fail("CACHEHIT_REQUIRE_REAL_ENGINE is set but vLLM is not installed", pytrace=False)
        pytest.skip("vLLM is not installed (run `engine-launcher install-deps --cpu`)")
    out = tmp_path / "run"
    assert (
        vllm_client.main(
            [
                "--out",
                str(out),
                "--num-prompts",
                "6",
                "--request-rate",
                "20",
                "--input-len",
                "48",
                "--output-len",
                "6",
                "--speed",
                "20",
            ]
        )
        == 0
    )
    for name in ("direct", "router"):
        r = json.loads((out / f"{name}.json").read_text())
        # Every request answered, each with its 6 tokens (ignore_eos), timed by vLLM's client.
        assert (r["completed"], r.get("failed", 0)) == (6, 0), r.get("errors")
        assert r["total_output_tokens"] == 36
        assert r["mean_ttft_ms"] > 0
        assert r["p99_itl_ms"] >= 0
    printed = capsys.readouterr().out
    assert "| direct | 6 | 0 |" in printed
    assert "| router | 6 | 0 |" in printed
