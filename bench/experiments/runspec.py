"""One replay run's parameters (`RunSpec`) and the simulated engines' flags for a workload."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.cluster import RouterOptions, SimOptions
from bench.workloads.spec import WorkloadSpec


@dataclass
class RunSpec:
    mode: str
    out: Path
    workload: WorkloadSpec
    engines: int = 4
    prefill: int = 1
    decoders_prefill: bool = False  # the decoders are NIXL producers too (role "both")
    sim: SimOptions = field(default_factory=SimOptions)
    router: RouterOptions = field(default_factory=RouterOptions)
    slo_ttft_ms: float = 1000.0
    slo_itl_ms: float = 100.0  # a request meets it when none of its gaps between tokens is longer
    pin: bool = False
    quiet: bool = False
    engines_per_process: int = 1
    routers: int = 1  # router replicas; requests round robin over them (bench/harness/replicas.py)
    restart_engine_at: float = 0.0  # > 0: restart one decode engine this many seconds in
    slow_engine_at: float = 0.0  # > 0: this many seconds in, one decode engine's steps slow down
    slowdown: float = 2.0  # by this factor (the simulator's slowdown fault)


def default_sim(w: WorkloadSpec, speed: float, num_gpu_blocks: int | None = None) -> SimOptions:
    """Engine flags for a workload. For the trace, every length shrinks by the same factor
    s = block_tokens / 512: KV capacity and the step token budget scale by s and the cost of
    one prompt token by 1/s, so one scaled request costs what the full-size one would on the
    simulator's default hardware (an 8B model on one H100)."""
    s = w.length_scale
    sim = SimOptions(speed=speed)
    if w.kind == "trace":
        sim.num_gpu_blocks = max(64, round(28000 * s))
        sim.max_num_batched_tokens = max(64, round(8192 * s))
        sim.prefill_token_s = 0.000050 / s
        sim.kv_transfer_token_s = 0.000004 / s
        sim.cpu_load_token_s = 0.0000026 / s
        sim.max_model_len = 16384
    elif w.kind == "prefix-groups":
        # Room for about a third of the groups' system prompts per engine (plus the running
        # requests): the cluster holds every group only if each engine keeps its own.
        per_prompt = -(-(w.system_tokens + w.question_tokens + w.output_tokens) // sim.block_size)
        sim.num_gpu_blocks = max(64, round(per_prompt * max(1.0, w.groups / 3)) + 48)
    elif w.kind == "multiturn":
        sim.num_gpu_blocks = 1024
    if num_gpu_blocks:
        sim.num_gpu_blocks = num_gpu_blocks
    return sim
