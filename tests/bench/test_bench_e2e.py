"""The bench end to end on a tiny scale: contract keys, per-request lines, compare, overhead pieces."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

from bench.cli import build_parser
from bench.experiments.options import run_spec_from_args
from bench.experiments.replay import SUMMARY_KEYS, run_replay
from bench.experiments.stream_cpu import profile_stream, summarise
from bench.harness.cluster import RouterOptions, histogram_quantile, router_toml
from bench.harness.load_clients import SMALL, BlockingClient, http_request
from bench.harness.procs import ProcessSet, free_ports
from bench.reports.render import compare
from bench.reports.rundir import load_requests
from router.routing import policies
from router.server.settings import parse_checked

TINY = [
    "--workload",
    "prefix-groups",
    "--groups",
    "2",
    "--per-group",
    "10",
    "--system-tokens",
    "128",
    "--question-tokens",
    "16",
    "--output-tokens",
    "8",
    "--rate",
    "20",
    "--speed",
    "20",
    "--engines",
    "2",
    "--prefill",
    "1",
    "--min-pd-prompt-tokens",
    "32",
]


def test_contract_command_line_parses() -> None:
    a = build_parser().parse_args(
        [
            "replay",
            "--trace",
            "t.jsonl",
            "--engines",
            "4",
            "--prefill",
            "1",
            "--mode",
            "probe",
            "--limit",
            "50",
            "--time-scale",
            "0.5",
            "--threshold",
            "0.3",
            "--out",
            "o",
        ]
    )
    assert (a.engines, a.prefill, a.mode, a.limit, a.time_scale, a.threshold) == (4, 1, "probe", 50, 0.5, 0.3)
    for cmd in (
        "compare d1 d2",
        "sweep-threshold --out o",
        "load-sweep --out o",
        "overhead --out o",
        "overhead --out o --streams 16 --profile",
        "overhead --out o --streams 16 --profile instant:16",
        "overhead --out o --streams 16 --stream-rounds 3 --base-checkout ../base",
        "stream-instructions --out o --streams 16 --base-checkout ../base --requests 100",
        "scaling --out o",
        "profile --out o",
        "replay --workload multiturn --mode all --out o",
    ):
        build_parser().parse_args(cmd.split())


def test_overhead_profile_takes_a_shape_and_a_length() -> None:
    assert build_parser().parse_args(["overhead", "--out", "o", "--streams", "16", "--profile"]).profile == "paced:256"
    assert profile_stream("instant:16") == ("instant", 16)
    for bad in ("instant", "steady:16", "paced:0", "paced:x"):
        with pytest.raises(SystemExit, match="SHAPE:CHUNKS"):
            profile_stream(bad)


def test_stream_rounds_are_summarised_against_the_floor_and_the_twin_of_each_round() -> None:
    def run(k: int, target: str, cpu: float) -> dict[str, object]:
        return {"round": k, "target": target, "shape": "instant", "chunks": 16, "cpu_us_per_req": cpu,
                "cpu_us_per_chunk": cpu / 16, "errors": 0}  # fmt: skip

    runs = [run(0, "passthrough", 100), run(0, "rr", 200), run(0, "rr@base", 250)]
    runs += [run(1, "passthrough", 200), run(1, "rr", 300), run(1, "rr@base", 300)]
    row = summarise([r for r in runs if r["target"] == "rr"], runs)
    assert row["cpu_us_per_req"] == 250.0
    assert row["x_passthrough_each"] == "2.00, 1.50"
    assert row["x_passthrough"] == 1.75
    assert row["x_base_each"] == "0.80, 1.00"
    assert summarise([r for r in runs if r["target"] == "rr@base"], runs)["x_base_each"] == ""


def test_generated_router_config_is_valid() -> None:
    text = router_toml(
        8000,
        ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        ["http://127.0.0.1:3"],
        RouterOptions(strategy="prefix_tree", threshold=0.3),
    )
    cfg = parse_checked(tomllib.loads(text))
    assert cfg.routing.strategy == "prefix_tree"
    assert policies.settings(cfg.routing, "probe").cache_hit_threshold == 0.3
    assert [b.role for b in cfg.backends] == ["decode", "decode", "prefill"]


def test_the_routing_flags_reach_the_router_config(tmp_path: Path) -> None:
    # The SLOs, the engines' chunk and the triage's bound go to the router as routing keys.
    a = build_parser().parse_args(["replay", *TINY, "--out", str(tmp_path), "--max-ttft-stretch", "6"])
    spec = run_spec_from_args(a, "probe_split_never", tmp_path)
    text = router_toml(8000, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], spec.router)
    cfg = parse_checked(tomllib.loads(text))
    assert cfg.routing.max_ttft_stretch == 6.0
    assert cfg.routing.split == "never"
    assert cfg.routing.slo_ttft_ms == a.slo_ttft_ms
    assert cfg.routing.prefill_chunk_tokens == spec.sim.max_num_batched_tokens
    # A smaller step budget for the engines, at full size: scaled like the trace's lengths,
    # and the router models the same chunk.
    a = build_parser().parse_args(["replay", *TINY, "--out", str(tmp_path), "--max-num-batched-tokens", "2048"])
    spec = run_spec_from_args(a, "probe", tmp_path)
    assert spec.sim.max_num_batched_tokens == max(16, round(2048 * spec.workload.length_scale))
    assert spec.router.extra_routing["prefill_chunk_tokens"] == spec.sim.max_num_batched_tokens
    # The decoders' own step budget: their engines' flag and their [[backends]] chunk, the
    # producers' left at the fleet's.
    a = build_parser().parse_args(["replay", *TINY, "--out", str(tmp_path), "--decoder-max-num-batched-tokens", "512"])
    spec = run_spec_from_args(a, "probe", tmp_path)
    chunk = max(16, round(512 * spec.workload.length_scale))
    assert spec.sim.args(decoder=0)[spec.sim.args(decoder=0).index("--max-num-batched-tokens") + 1] == str(chunk)
    assert spec.sim.args()[spec.sim.args().index("--max-num-batched-tokens") + 1] == "8192"
    text = router_toml(8000, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], spec.router)
    cfg = parse_checked(tomllib.loads(text))
    assert [b.prefill_chunk_tokens for b in cfg.backends] == [chunk, 0]
    assert cfg.routing.prefill_chunk_tokens == 8192


def test_decoders_that_prefill_too_split_prompts_between_them(tmp_path: Path) -> None:
    # --decoders-prefill: the decoders are NIXL producers too (kv_both, router role "both");
    # with no producer of its own, every split prefills on one decoder and decodes on another.
    a = build_parser().parse_args(["replay", *TINY, "--out", str(tmp_path), "--decoders-prefill", "--prefill", "0"])
    spec = run_spec_from_args(a, "probe_split_always", tmp_path)
    assert spec.decoders_prefill
    text = router_toml(8000, ["http://127.0.0.1:1", "http://127.0.0.1:2"], [], spec.router, None, 1, True)
    assert [b.role for b in parse_checked(tomllib.loads(text)).backends] == ["both", "both"]
    s = asyncio.run(run_replay(spec))
    assert s["errors"] == 0, s["error_examples"]
    lines = [json.loads(x) for x in (tmp_path / "logs" / "router.log").read_text().splitlines() if x.startswith("{")]
    splits = [x for x in lines if x.get("route") == "pd"]
    assert splits, s["routes"]
    assert all(x["prefill"] in ("d0", "d1") and x["winner"] != x["prefill"] for x in splits)


def test_generated_router_config_declares_the_decoders_dp_ranks_or_hides_them() -> None:
    decoders = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    declared = parse_checked(tomllib.loads(router_toml(8000, decoders, [], RouterOptions(), None, 2)))
    assert [b.name for b in declared.backends] == ["d0-dp0", "d0-dp1", "d1-dp0", "d1-dp1"]
    hidden = RouterOptions(declare_data_parallel=False)
    undeclared = parse_checked(tomllib.loads(router_toml(8000, decoders, [], hidden, None, 2)))
    assert [b.name for b in undeclared.backends] == ["d0", "d1"]


def test_histogram_quantile() -> None:
    b = [(0.01, 0.0), (0.1, 50.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(b, 0.5) == pytest.approx(0.1)
    assert histogram_quantile(b, 0.25) == pytest.approx(0.055)
    assert histogram_quantile([(float("inf"), 0.0)], 0.5) is None


def test_tiny_replay_probe_and_oracle(tmp_path: Path) -> None:
    a = build_parser().parse_args(["replay", *TINY, "--out", str(tmp_path)])
    dirs = []
    for mode in ("oracle", "probe", "round_robin"):
        spec = run_spec_from_args(a, mode, tmp_path / mode)
        s = asyncio.run(run_replay(spec))
        for k in SUMMARY_KEYS:
            assert k in s, k
        assert s["requests"] == 20
        dirs.append(tmp_path / mode)
        if mode == "oracle":
            assert 0.5 < s["oracle_hit_ratio"] < 1.0
            continue
        assert s["errors"] == 0, s["error_examples"]
        assert 0.0 <= s["hit_ratio"] <= s["oracle_hit_ratio"] + 1e-9
        assert s["router_cpu_s_per_1k"] > 0
        assert s["router_rss_mb"] > 10
        rows = load_requests(tmp_path / mode)
        assert len(rows) == 20
        assert all(r["status"] == 200 and r["output_tokens"] == 8 and r["ttft_ms"] is not None for r in rows)
        assert all(r["route"] in ("probe_hit", "pd", "direct") for r in rows)
        if mode == "probe":
            # Whether to race is the cost model's call (short prompts on fast engines often
            # go straight); the router's log and its metrics must count the same probes,
            # and every probe hit was raced.
            assert s["probes_per_request"] == pytest.approx(s["probes_per_request_metrics"], abs=0.01)
            assert s["probes_per_request"] * 20 >= s["routes"].get("probe_hit", 0)
        else:
            assert s["probes_per_request"] == 0.0
    rows = compare(dirs, tmp_path)
    assert [r["label"] for r in rows] == ["oracle", "probe", "round_robin"]
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 1000
    assert (tmp_path / "hit_ratio.png").exists()
    assert (tmp_path / "compare.md").exists()


def test_instant_backend_answers_in_vllm_shapes(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    with ProcessSet(tmp_path) as procs:
        p = procs.start(
            "instant", [sys.executable, "-m", "bench.harness.instant_backend", "--port", str(port), "--chunks", "4"]
        )
        from bench.harness.procs import wait_http

        asyncio.run(wait_http(f"http://127.0.0.1:{port}/health", p, 30))
        c = BlockingClient(port)
        t, first, status = c.roundtrip(http_request("127.0.0.1", port, "/v1/completions", SMALL))
        assert status == 200
        assert first <= t
        t, first, status = c.roundtrip(
            http_request(
                "127.0.0.1",
                port,
                "/v1/completions",
                {**SMALL, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
            )
        )
        assert status == 200
        c.close()
        import urllib.request

        body = json.dumps(
            {**SMALL, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        answers = []
        for _ in range(2):
            text = urllib.request.urlopen(req, timeout=10).read().decode()
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            answers.append([json.loads(e) for e in events[:-1]])
        chunks = answers[0]
        assert [c["choices"][0]["text"] for c in chunks[:4]] == [" tok"] * 4
        assert chunks[0]["choices"][0]["prompt_token_ids"]
        assert chunks[3]["choices"][0]["finish_reason"] == "length"
        assert chunks[4]["usage"]["completion_tokens"] == 4
        # An id of its own per answer, as vLLM's: one across the answer's chunks.
        ids = [{c["id"] for c in a} for a in answers]
        assert all(len(i) == 1 and re.fullmatch(r"cmpl-[0-9a-f]{32}", next(iter(i))) for i in ids)
        assert ids[0] != ids[1]


def test_scaling_idle_measures_the_router_with_no_traffic(tmp_path: Path) -> None:
    from bench.experiments.scaling import main as scaling_main

    a = build_parser().parse_args(["scaling", "--out", str(tmp_path), "--ks", "2", "--idle-only", "--idle-s", "1"])
    assert scaling_main(a) == 0
    rows = json.loads((tmp_path / "scaling.json").read_text())["idle_rows"]
    assert [(r["k"], r["strategy"]) for r in rows] == [(2, "probe"), (2, "round_robin")]
    # CPU time counts in clock ticks (10 ms): a second of two engines' scrapes may read 0.
    assert all(r["cpu_pct"] >= 0 and r["scrapes_per_s"] == 4.0 for r in rows)
    assert "router CPU % of a core" in (tmp_path / "scaling.md").read_text()


def test_kv_events_cpu_follows_every_batch_into_the_routers_index(tmp_path: Path) -> None:
    from bench.experiments.kv_events_cpu import main as kv_events_cpu_main

    a = build_parser().parse_args(["kv-events-cpu", "--out", str(tmp_path), "--batches", "300", "--reps", "1"])
    assert kv_events_cpu_main(a) == 0
    result = json.loads((tmp_path / "kv_events_cpu.json").read_text())
    # Each batch stores one block of its own: all reached the index through the router's stream.
    assert result["indexed_blocks"] == 300
    assert len(result["us_per_batch"]) == 1
    assert "router CPU us/batch" in (tmp_path / "kv_events_cpu.md").read_text()
