"""Offered load from the simulator's timing model, and the suite's rate derivation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.cli import build_parser
from bench.experiments import capacity, suite, suite_workloads
from bench.harness.cluster import SimOptions
from engine_launcher.sim.config import TimingModel

T = TimingModel()


def test_request_work_is_the_timing_model_per_request() -> None:
    sim = SimOptions(speed=2.0, max_num_batched_tokens=100)
    # 250 prompt tokens: 3 prefill chunks of <= 100 tokens, each step paying the overhead once.
    want = (T.prefill_token_s * 250 + T.decode_seq_s * 10 + T.step_overhead_s * 3) / 2.0
    assert capacity.request_work_s(250, 10, sim) == pytest.approx(want)
    # A fully cached prompt still costs one step (the last token is always computed).
    assert capacity.request_work_s(0, 1, sim) == pytest.approx((T.decode_seq_s + T.step_overhead_s) / 2.0)
    # The bench's length-scaled engines override the per-token prefill cost.
    scaled = SimOptions(prefill_token_s=0.0008, max_num_batched_tokens=512)
    assert capacity.request_work_s(512, 0, scaled) == pytest.approx(0.0008 * 512 + T.step_overhead_s)


def test_offered_load_is_work_per_second_per_engine() -> None:
    sim = SimOptions(speed=1.0, max_num_batched_tokens=8192)
    prompts, hits, outs = [1000, 3000], [0, 2000], [50, 50]
    load = capacity.offered_load(prompts, hits, outs, span_s=2.0, sim=sim, engines=4, prefill=1)
    w = [capacity.request_work_s(p, o, sim) for p, o in zip(prompts, outs, strict=False)]
    w_oracle = [capacity.request_work_s(p - h, o, sim) for p, h, o in zip(prompts, hits, outs, strict=False)]
    assert load.utilisation == pytest.approx(sum(w) / 2.0 / 4)
    assert load.utilisation_oracle == pytest.approx(sum(w_oracle) / 2.0 / 4)
    assert load.utilisation_oracle < load.utilisation
    assert load.offered_rps == 1.0
    # Every prompt on the one prefill engine: prefill work only, per prefill engine.
    pd = sum(capacity.prefill_work_s(p, sim) for p in prompts) / 2.0
    assert load.pd_prefill_utilisation == pytest.approx(pd)
    # With the oracle's hits the producer computes only what is left: the 2,000 held tokens not.
    pd_oracle = sum(capacity.prefill_work_s(p - h, sim) for p, h in zip(prompts, hits, strict=False)) / 2.0
    assert load.pd_prefill_utilisation_oracle == pytest.approx(pd_oracle)
    assert pd_oracle < pd
    # Twice the engines: half the utilisation.
    assert capacity.offered_load(prompts, hits, outs, 2.0, sim, 8).utilisation == pytest.approx(load.utilisation / 2)
    with pytest.raises(ValueError, match="needs requests"):
        capacity.offered_load([], [], [], 1.0, sim, 4)


def test_decoder_prefill_share_is_what_the_producers_cannot_take() -> None:
    def load(pd_oracle: float | None) -> capacity.Load:
        return capacity.Load(1, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, pd_oracle, pd_oracle)

    # Producers at 4x their capacity take a quarter; decoders compute the other three quarters.
    assert load(4.0).decoder_prefill_share == pytest.approx(0.75)
    # Within the producers' capacity nothing has to be computed on a decoder.
    assert load(0.5).decoder_prefill_share == 0.0
    assert load(None).decoder_prefill_share is None


def _suite_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["suite", "--out", str(tmp_path), *extra])


@pytest.mark.parametrize("name", ["low-reuse", "hetero", "overload"])
def test_suite_sets_the_rate_for_its_target_utilisation(tmp_path: Path, name: str) -> None:
    trace = tmp_path / "t.jsonl"
    from bench.workloads import trace_gen as tg

    tg.write(trace, tg.generate(tg.TraceParams(duration_s=200.0)))
    wd = suite_workloads.BY_NAME[name]
    assert wd.target is not None  # each of these aims at a utilisation
    a = _suite_args(tmp_path, "--requests", "60", "--trace", str(trace))
    ns = suite.replay_args(a, wd, tmp_path / name)
    before = suite.workload_load(ns)
    load = suite.set_rate(ns, wd)
    assert before is not None  # an open-loop workload has a rate to set
    assert load is not None
    assert load["utilisation"] == pytest.approx(wd.target, rel=1e-6)
    assert load["requests"] == 60
    assert load["engines"] == 4
    assert load["speed"] == wd.speed
    # The same work over a span stretched or shrunk by utilisation / target.
    assert load["work_s"] == pytest.approx(before.work_s)
    assert load["span_s"] == pytest.approx(before.span_s * before.utilisation / wd.target, rel=1e-6)
    # Twice the engines take twice the rate for the same utilisation.
    ns8 = suite.replay_args(
        _suite_args(tmp_path, "--requests", "60", "--trace", str(trace), "--engines", "8"), wd, tmp_path / name
    )
    load8 = suite.set_rate(ns8, wd)
    assert load8 is not None
    assert load8["offered_rps"] == pytest.approx(2 * load["offered_rps"], rel=1e-6)


def test_bursty_keeps_the_near_capacity_mean_rate(tmp_path: Path) -> None:
    a = _suite_args(tmp_path, "--requests", "200")
    near = suite.set_rate(
        suite.replay_args(a, suite_workloads.BY_NAME["low-reuse"], tmp_path), suite_workloads.BY_NAME["low-reuse"]
    )
    ns = suite.replay_args(a, suite_workloads.BY_NAME["bursty"], tmp_path)
    bursty = suite.set_rate(ns, suite_workloads.BY_NAME["bursty"])
    assert near is not None  # both open-loop: a rate is set
    assert bursty is not None
    assert (ns.burst_on_s, ns.burst_off_s) == suite_workloads.BY_NAME["bursty"].bursts
    assert bursty["time_scale"] == pytest.approx(near["time_scale"])
    # Same requests and mean rate (the last burst may end early: within one on/off period).
    period = sum(suite_workloads.BY_NAME["bursty"].bursts)
    assert abs(bursty["span_s"] - near["span_s"]) < period
    assert bursty["work_s"] == pytest.approx(near["work_s"])


def test_cpu_tier_workload_runs_small_gpus_with_a_cpu_tier_unless_the_suite_says_otherwise(tmp_path: Path) -> None:
    from bench.experiments.options import run_spec_from_args

    wd = suite_workloads.BY_NAME["cpu-tier"]
    ns = suite.replay_args(_suite_args(tmp_path), wd, tmp_path)
    sim = run_spec_from_args(ns, "probe", tmp_path).sim
    assert sim.num_gpu_blocks == suite_workloads.CPU_TIER_GPU_BLOCKS
    assert sim.cpu_offload_x == 8.0
    assert "--cpu-offload-tokens" in sim.args()
    # The suite's own cluster flags win; the other workloads keep the simulator's defaults.
    ns = suite.replay_args(_suite_args(tmp_path, "--num-gpu-blocks", "900", "--cpu-offload-x", "2"), wd, tmp_path)
    assert (ns.num_gpu_blocks, ns.cpu_offload_x) == (900, 2.0)
    ns = suite.replay_args(_suite_args(tmp_path), suite_workloads.BY_NAME["low-reuse"], tmp_path)
    assert (ns.num_gpu_blocks, ns.cpu_offload_x) == (0, 0.0)


def test_mixed_speed_slows_one_decoder_and_sets_the_rate_for_the_fleet_it_leaves(tmp_path: Path) -> None:
    from bench.experiments.options import run_spec_from_args

    wd = suite_workloads.BY_NAME["mixed-speed"]
    a = _suite_args(tmp_path, "--requests", "60")
    ns = suite.replay_args(a, wd, tmp_path)
    sim = run_spec_from_args(ns, "probe", tmp_path).sim
    # The first decoder at half the others' speed; the producer at the fleet's.
    speeds = [float(sim.args(i)[sim.args(i).index("--speed") + 1]) for i in range(4)]
    assert speeds == [wd.speed * 0.5, wd.speed, wd.speed, wd.speed]
    assert float(sim.args()[sim.args().index("--speed") + 1]) == wd.speed
    # Its rate is set for 3.5 engines' worth: 3.5 / 4 of low-reuse's, the same requests.
    load = suite.set_rate(ns, wd)
    low_reuse = suite_workloads.BY_NAME["low-reuse"]
    alike = suite.set_rate(suite.replay_args(a, low_reuse, tmp_path), low_reuse)
    assert load is not None
    assert alike is not None
    assert load["offered_rps"] == pytest.approx(alike["offered_rps"] * 3.5 / 4, rel=1e-6)
    # Bad factors are named: more than the engines, or not positive.
    for bad in ("1,1,1,1,1", "0", "fast"):
        flags = build_parser().parse_args(["replay", "--out", str(tmp_path), "--decoder-speed-factors", bad])
        with pytest.raises(SystemExit, match="--decoder-speed-factors"):
            run_spec_from_args(flags, "probe", tmp_path)


def test_closed_loop_multiturn_has_no_utilisation(tmp_path: Path) -> None:
    ns = suite.replay_args(_suite_args(tmp_path), suite_workloads.BY_NAME["multiturn"], tmp_path)
    assert suite.set_rate(ns, suite_workloads.BY_NAME["multiturn"]) is None


def test_default_trace_is_generated_inside_the_repository(tmp_path: Path) -> None:
    from bench.experiments.options import workload_from_args

    a = build_parser().parse_args(["replay", "--out", str(tmp_path)])
    w = workload_from_args(a)
    repo = Path(suite.__file__).resolve().parents[2]
    assert Path(w.trace).is_relative_to(repo)
    assert Path(w.trace).exists()
    first = json.loads(Path(w.trace).read_text().splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}
    a = build_parser().parse_args(["replay", "--out", str(tmp_path), "--trace", "other.jsonl"])
    assert workload_from_args(a).trace == "other.jsonl"


def test_ample_producers_runs_four_producers_at_the_low_reuse_rate(tmp_path: Path) -> None:
    wd = suite_workloads.BY_NAME["ample-producers"]
    a = _suite_args(tmp_path, "--requests", "60")
    ns = suite.replay_args(a, wd, tmp_path)
    assert ns.prefill == 4
    ample = suite.set_rate(ns, wd)
    low_reuse = suite_workloads.BY_NAME["low-reuse"]
    low = suite.set_rate(suite.replay_args(a, low_reuse, tmp_path), low_reuse)
    assert ample is not None
    assert low is not None
    # The decoders' utilisation sets the rate: the producers added take nothing from it.
    assert ample["offered_rps"] == pytest.approx(low["offered_rps"])
    assert ample["pd_prefill_utilisation"] == pytest.approx(low["pd_prefill_utilisation"] / 4)
    # A --prefill other than the default wins.
    assert suite.replay_args(_suite_args(tmp_path, "--prefill", "2"), wd, tmp_path).prefill == 2
