"""The workload and cluster flags every replay-based command shares, and the `RunSpec` they
make: `replay`, `suite`, `fleet` and the sweeps read their arguments through here."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.experiments.runspec import RunSpec, default_sim
from bench.harness.cluster import RouterOptions, peer_executable
from bench.harness.modes import (
    ALL_MODES,
    EXTERNAL_MODES,
    ORACLE,
    PROBE,
    ROUTER_MODES,
    SMG_MODES,
    SPLIT_MODES,
    SUITE_MODES,
)
from bench.workloads.spec import WorkloadSpec
from bench.workloads.trace_gen import cached_trace


def default_trace() -> str:
    """The generated multi-turn conversation trace (bench/workloads/trace_gen.py), made on first use."""
    return str(cached_trace())


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("trace", "prefix-groups", "multiturn", "hetero"), default="trace")
    g.add_argument(
        "--trace",
        help="Mooncake-format JSONL (default: the generated conversation trace of bench/workloads/trace_gen.py)",
    )
    g.add_argument("--limit", type=int, help="N requests of the trace (default 400; see --window)")
    g.add_argument(
        "--window",
        choices=("tail", "head"),
        default="tail",
        help="which N requests: the last N (default; the Mooncake trace's prefix reuse builds up "
        "over its 17 minutes, so its tail is where it shows) or the first N after --offset",
    )
    g.add_argument("--offset", type=int, default=0, help="with --window head: skip the first N requests")
    g.add_argument(
        "--time-scale", type=float, default=0.5, help="multiply trace timestamps (0.5: 2x faster; default %(default)s)"
    )
    g.add_argument(
        "--block-tokens",
        type=int,
        default=32,
        help="tokens per 512-token trace block (length scale = N/512; default %(default)s)",
    )
    g.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    g.add_argument("--max-output", type=int, default=0, help="cap output lengths (0: none)")
    g.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="Poisson arrivals at this rate/s (trace: instead of its timestamps; "
        "prefix-groups default 8; multiturn: session starts, default 1)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--groups", type=int, default=12, help="prefix-groups: groups")
    g.add_argument("--per-group", type=int, default=24, help="prefix-groups: prompts per group")
    g.add_argument("--system-tokens", type=int, default=2048, help="shared system prompt length")
    g.add_argument("--question-tokens", type=int, default=64, help="prefix-groups: question length")
    g.add_argument("--output-tokens", type=int, default=64, help="prefix-groups/multiturn: output length")
    g.add_argument("--sessions", type=int, default=16, help="multiturn: sessions")
    g.add_argument("--turns", type=int, default=6, help="multiturn: turns per session")
    g.add_argument("--message-tokens", type=int, default=64, help="multiturn: user message length")
    g.add_argument("--think-s", type=float, default=0.5, help="multiturn: pause between turns")
    g.add_argument("--min-prompt-tokens", type=int, default=32, help="hetero: shortest prompt")
    g.add_argument("--max-prompt-tokens", type=int, default=8000, help="hetero: longest prompt")
    g.add_argument(
        "--burst-on-s",
        type=float,
        default=0.0,
        help="with --burst-off-s: arrivals in bursts of this long at the same mean rate",
    )
    g.add_argument("--burst-off-s", type=float, default=0.0, help="silence between bursts")
    g.add_argument(
        "--arrival-cv",
        type=float,
        default=0.0,
        help="> 1: arrivals re-timed as a gamma process with this coefficient of variation, same mean rate",
    )


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--engines", "-K", type=int, default=4, help="decode engines (default %(default)s)")
    g.add_argument("--prefill", "-P", type=int, default=1, help="prefill engines (default %(default)s)")
    g.add_argument(
        "--decoders-prefill",
        action="store_true",
        help='the decode engines are NIXL producers too (kv_both, router role "both"): a split '
        "may prefill on one decoder and decode on another, besides the --prefill engines",
    )
    g.add_argument("--speed", type=float, default=0.0, help="simulator time compression (default: trace 3, others 1)")
    g.add_argument(
        "--num-gpu-blocks", type=int, default=0, help="KV blocks per engine (default: scaled from the workload)"
    )
    g.add_argument("--max-num-seqs", type=int, default=0, help="per engine (default: simulator's)")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="every engine's token budget per step (vLLM's prefill chunk) at full size, scaled "
        "with the trace's lengths as the rest (default 8192: vLLM's); also the router's "
        "routing.prefill_chunk_tokens",
    )
    g.add_argument(
        "--decoder-max-num-batched-tokens",
        type=int,
        default=0,
        help="the decode engines' own step budget at full size, scaled the same way (default: "
        "--max-num-batched-tokens'), given to the router as their [[backends]] prefill_chunk_tokens: "
        "a small chunk on the decoders, whose steps stall their sequences, beside the producers' large one",
    )
    g.add_argument(
        "--decoder-speed-factors",
        default="",
        help="the first decode engines' speeds as shares of --speed, comma-separated, the others "
        "at 1 (e.g. 0.5: one engine of half the others' speed, as an older GPU; default: all "
        "alike). The router is not told: it learns each engine's speed",
    )
    g.add_argument(
        "--cpu-offload-x",
        type=float,
        default=0.0,
        help="CPU tier of each engine's KV cache (vLLM's OffloadingConnector) as a "
        "multiple of its GPU KV capacity (default 0: none)",
    )
    g.add_argument("--no-arrival-check", action="store_true", help="engines check the threshold only at admission")
    g.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="DP ranks (KV caches) behind each decode engine's port, declared to the router "
        "(backends[].data_parallel_size; default %(default)s)",
    )
    g.add_argument(
        "--undeclared-data-parallel",
        action="store_true",
        help="with --data-parallel-size: do not declare the ranks (the router sees one engine per server)",
    )
    g.add_argument("--threshold", type=float, default=0.5, help="routing.cache_hit_threshold")
    g.add_argument("--probe-deadline-ms", type=float, default=250.0, help="routing.probe_deadline_ms")
    g.add_argument("--max-probes", type=int, default=0, help="routing.max_probes (0: probe every engine)")
    g.add_argument(
        "--min-pd-prompt-tokens",
        type=int,
        default=-1,
        help="routing.min_pd_prompt_tokens (default: 256 tokens, length-scaled)",
    )
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT SLO for goodput (also the router's)")
    g.add_argument(
        "--slo-itl-ms",
        type=float,
        default=100.0,
        help="ITL SLO for goodput: no gap between tokens longer (also the router's)",
    )
    g.add_argument(
        "--max-ttft-stretch",
        type=float,
        default=0.0,
        help="routing.max_ttft_stretch (0: no bound on how late goodput's triage places a request)",
    )
    g.add_argument(
        "--spare-producers",
        choices=("auto", "always", "never"),
        default="auto",
        help="routing.spare_producers: whether a request late wherever it goes may be split "
        "through an idle producer while another stays idle (default %(default)s)",
    )
    g.add_argument(
        "--engines-per-process",
        type=int,
        default=1,
        help="simulated engines per process (default 1: each engine its own process; 0: one process per role)",
    )
    g.add_argument(
        "--pin", action="store_true", help="pin the router to the last core and everything else to the others"
    )


def workload_from_args(a: argparse.Namespace) -> WorkloadSpec:
    trace = a.trace or (default_trace() if a.workload == "trace" else "")
    return WorkloadSpec(
        kind=a.workload,
        trace=trace,
        limit=a.limit,
        offset=a.offset,
        window=a.window,
        time_scale=a.time_scale,
        block_tokens=a.block_tokens,
        output_scale=a.output_scale,
        max_output=a.max_output,
        rate=a.rate,
        seed=a.seed,
        groups=a.groups,
        per_group=a.per_group,
        system_tokens=a.system_tokens,
        question_tokens=a.question_tokens,
        output_tokens=a.output_tokens,
        sessions=a.sessions,
        turns=a.turns,
        message_tokens=a.message_tokens,
        think_s=a.think_s,
        min_prompt_tokens=a.min_prompt_tokens,
        max_prompt_tokens=a.max_prompt_tokens,
        burst_on_s=a.burst_on_s,
        arrival_cv=getattr(a, "arrival_cv", 0.0),
        burst_off_s=a.burst_off_s,
    )


def speed_factors(text: str, engines: int) -> tuple[float, ...]:
    """--decoder-speed-factors: a positive share for each decode engine (empty: all alike)."""
    if not text:
        return ()
    try:
        factors = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--decoder-speed-factors: numbers separated by commas, got {text!r}") from None
    if len(factors) > engines or not all(f > 0 for f in factors):
        raise SystemExit(
            f"--decoder-speed-factors: up to {engines} positive numbers (the decode engines'), got {text!r}"
        )
    return factors + (1.0,) * (engines - len(factors))


def run_spec_from_args(a: argparse.Namespace, mode: str, out: Path, **router_over: Any) -> RunSpec:
    w = workload_from_args(a)
    speed = a.speed or (3.0 if w.kind == "trace" else 1.0)
    sim = default_sim(w, speed, a.num_gpu_blocks or None)
    sim.arrival_check = not a.no_arrival_check
    if a.max_num_seqs:
        sim.max_num_seqs = a.max_num_seqs
    if getattr(a, "max_num_batched_tokens", 0):
        sim.max_num_batched_tokens = max(16, round(a.max_num_batched_tokens * w.length_scale))
    if getattr(a, "decoder_max_num_batched_tokens", 0):
        sim.decoder_max_num_batched_tokens = max(16, round(a.decoder_max_num_batched_tokens * w.length_scale))
    sim.cpu_offload_x = getattr(a, "cpu_offload_x", 0.0)
    sim.decoder_speed_factors = speed_factors(getattr(a, "decoder_speed_factors", ""), a.engines)
    sim.data_parallel_size = getattr(a, "data_parallel_size", 1)
    min_pd = a.min_pd_prompt_tokens if a.min_pd_prompt_tokens >= 0 else max(1, round(256 * w.length_scale))
    ropts = RouterOptions(
        strategy=mode if mode in ROUTER_MODES else PROBE,
        threshold=a.threshold,
        probe_deadline_ms=a.probe_deadline_ms,
        min_pd_prompt_tokens=min_pd,
        max_probes=a.max_probes,
        declare_data_parallel=not getattr(a, "undeclared_data_parallel", False),
    )
    # The router optimises the goodput the bench measures: the same SLOs, the engines' chunk.
    ropts.extra_routing = {
        "slo_ttft_ms": float(a.slo_ttft_ms),
        "slo_itl_ms": float(getattr(a, "slo_itl_ms", 100.0)),
        "prefill_chunk_tokens": int(sim.max_num_batched_tokens),
        "max_ttft_stretch": float(getattr(a, "max_ttft_stretch", 0.0)),
        "spare_producers": str(getattr(a, "spare_producers", "auto")),
        **({"split": SPLIT_MODES[mode]} if mode in SPLIT_MODES else {}),
    }
    if sim.decoder_max_num_batched_tokens:
        ropts.decoder_keys = {"prefill_chunk_tokens": int(sim.decoder_max_num_batched_tokens)}
    for k, v in router_over.items():
        setattr(ropts, k, v)
    return RunSpec(
        mode=mode,
        out=out,
        workload=w,
        engines=a.engines,
        prefill=a.prefill,
        decoders_prefill=getattr(a, "decoders_prefill", False),
        sim=sim,
        router=ropts,
        slo_ttft_ms=a.slo_ttft_ms,
        slo_itl_ms=getattr(a, "slo_itl_ms", 100.0),
        pin=a.pin,
        engines_per_process=getattr(a, "engines_per_process", 1),
        routers=getattr(a, "routers", 1),
        restart_engine_at=getattr(a, "restart_engine_at", 0.0),
        slow_engine_at=getattr(a, "slow_engine_at", 0.0),
        slowdown=getattr(a, "slowdown", 2.0),
    )


def expand_modes(text: str) -> list[str]:
    if text == "all":
        return [*SUITE_MODES, *vllm_router_modes()]
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in ALL_MODES:
            raise SystemExit(f"unknown mode {m!r}: one of {', '.join(ALL_MODES)} or 'all'")
    return modes


def vllm_router_modes() -> list[str]:
    try:
        peer_executable("vllm-router")
    except RuntimeError:  # not installed: its modes are left out
        return []
    return list(EXTERNAL_MODES)


def apply_quick(a: argparse.Namespace) -> None:
    if not getattr(a, "quick", False):
        return
    if a.workload == "trace":
        a.limit = a.limit or 150
    elif a.workload == "prefix-groups":
        a.per_group = min(a.per_group, 8)
        a.groups = min(a.groups, 4)
    else:
        a.sessions = min(a.sessions, 6)
        a.turns = min(a.turns, 3)


def add_replay_args(p: argparse.ArgumentParser) -> None:
    """The flags of `replay`; the suite and the sweeps parse a replay's arguments with them."""
    add_workload_args(p)
    add_cluster_args(p)
    p.add_argument(
        "--mode",
        default="probe",
        help=f"{' | '.join((*ROUTER_MODES, *SPLIT_MODES, ORACLE, *EXTERNAL_MODES, *SMG_MODES))}, a comma list, or 'all' "
        "(each into OUT/<mode>)",
    )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router replicas in front of the same engines, requests round robin over them "
        "(bench/harness/replicas.py; default %(default)s)",
    )
    p.add_argument(
        "--restart-engine-at",
        type=float,
        default=0.0,
        metavar="S",
        help="restart one decode engine S seconds into the run (its cache is lost); "
        "summary.json gets the hit ratio before and per 25 requests after",
    )
    p.add_argument(
        "--slow-engine-at",
        type=float,
        default=0.0,
        metavar="S",
        help="S seconds into the run, one decode engine's steps start taking --slowdown times as "
        "long (a neighbour on its GPU); the router is not told",
    )
    p.add_argument("--slowdown", type=float, default=2.0, help="with --slow-engine-at (default %(default)s)")
    p.add_argument("--out", required=True)
    p.add_argument("--label", help="name of the run in compare tables (default: the mode)")
    p.add_argument("--full", action="store_true", help="the whole trace (default: first 400 requests)")
    p.add_argument("--quick", action="store_true", help="a small run (trace: 150 requests)")
