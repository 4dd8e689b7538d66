"""`python -m bench <subcommand>`: the benchmark suite (docs/BENCHMARKS.md).

replay           a workload through one or more routing modes (summary.json, requests.jsonl)
compare          one table and PNG plots from run directories
sweep-threshold  probe mode at T = 0.1 .. 0.9
load-sweep       offered load from light to past capacity; rejection latency on a full engine
offload-sweep    hit ratio and TTFT against each engine's CPU KV tier (F x its GPU capacity)
overhead         latency and throughput the router adds over an instant backend
scaling          router CPU and memory as K grows, and with 1,000 open streams
profile          py-spy profile of the router under load (hot functions)
sim-capacity     the simulator's own capacity (bench/sim_capacity.py)
soak             a long steady load with engine restarts (bench/soak.py)
suite            every routing mode on every suite workload: one regret table (bench/suite.py)
slow-readers     router memory under streams whose clients never read (bench/slow_readers.py)
fairness         one tenant's TTFT while another floods the router past its limits (bench/fairness.py)
engine-idle      idle CPU and NIXL transfer time of real vLLM engines (bench/engine_idle.py)
fleet            router replicas N = 1, 2, 4 on several workloads, one table (bench/fleet_table.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


def default_trace() -> str:
    """The generated multi-turn conversation trace (bench/trace_gen.py), made on first use."""
    from .trace_gen import cached_trace

    return str(cached_trace())


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("trace", "prefix-groups", "multiturn", "hetero"), default="trace")
    g.add_argument(
        "--trace", help="Mooncake-format JSONL (default: the generated conversation trace of bench/trace_gen.py)"
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


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--engines", "-K", type=int, default=4, help="decode engines (default %(default)s)")
    g.add_argument("--prefill", "-P", type=int, default=1, help="prefill engines (default %(default)s)")
    g.add_argument("--speed", type=float, default=0.0, help="simulator time compression (default: trace 3, others 1)")
    g.add_argument(
        "--num-gpu-blocks", type=int, default=0, help="KV blocks per engine (default: scaled from the workload)"
    )
    g.add_argument("--max-num-seqs", type=int, default=0, help="per engine (default: simulator's)")
    g.add_argument(
        "--cpu-offload-x",
        type=float,
        default=0.0,
        help="CPU tier of each engine's KV cache (vLLM's OffloadingConnector) as a "
        "multiple of its GPU KV capacity (default 0: none)",
    )
    g.add_argument("--no-arrival-check", action="store_true", help="engines check the threshold only at admission")
    g.add_argument("--threshold", type=float, default=0.5, help="routing.cache_hit_threshold")
    g.add_argument("--probe-deadline-ms", type=float, default=250.0, help="routing.probe_deadline_ms")
    g.add_argument("--max-probes", type=int, default=0, help="routing.max_probes (0: probe every engine)")
    g.add_argument(
        "--min-pd-prompt-tokens",
        type=int,
        default=-1,
        help="routing.min_pd_prompt_tokens (default: 256 tokens, length-scaled)",
    )
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT SLO for goodput")
    g.add_argument(
        "--engines-per-process",
        type=int,
        default=1,
        help="simulated engines per process (default 1: each engine its own process; 0: one process per role)",
    )
    g.add_argument(
        "--pin", action="store_true", help="pin the router to the last core and everything else to the others"
    )


def workload_from_args(a: argparse.Namespace):
    from .replay import WorkloadSpec

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
        burst_off_s=a.burst_off_s,
    )


def run_spec_from_args(a: argparse.Namespace, mode: str, out: Path, **router_over):
    from .cluster import ROUTER_MODES, RouterOptions
    from .replay import RunSpec, default_sim

    w = workload_from_args(a)
    speed = a.speed or (3.0 if w.kind == "trace" else 1.0)
    sim = default_sim(w, speed, a.num_gpu_blocks or None)
    sim.arrival_check = not a.no_arrival_check
    if a.max_num_seqs:
        sim.max_num_seqs = a.max_num_seqs
    sim.cpu_offload_x = getattr(a, "cpu_offload_x", 0.0)
    min_pd = a.min_pd_prompt_tokens if a.min_pd_prompt_tokens >= 0 else max(1, round(256 * w.length_scale))
    ropts = RouterOptions(
        strategy=mode if mode in ROUTER_MODES else "probe",
        threshold=a.threshold,
        probe_deadline_ms=a.probe_deadline_ms,
        min_pd_prompt_tokens=min_pd,
        max_probes=a.max_probes,
    )
    for k, v in router_over.items():
        setattr(ropts, k, v)
    return RunSpec(
        mode=mode,
        out=out,
        workload=w,
        engines=a.engines,
        prefill=a.prefill,
        sim=sim,
        router=ropts,
        slo_ttft_ms=a.slo_ttft_ms,
        pin=a.pin,
        engines_per_process=getattr(a, "engines_per_process", 1),
        routers=getattr(a, "routers", 1),
        restart_engine_at=getattr(a, "restart_engine_at", 0.0),
    )


def expand_modes(text: str) -> list[str]:
    from .replay import ALL_MODES

    if text == "all":
        return ["oracle", "probe", "prefix_tree", "least_loaded", "round_robin", *vllm_router_modes()]
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in ALL_MODES:
            raise SystemExit(f"unknown mode {m!r}: one of {', '.join(ALL_MODES)} or 'all'")
    return modes


def vllm_router_modes() -> list[str]:
    from .cluster import EXTERNAL_MODES, peer_executable

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


def cmd_replay(a: argparse.Namespace) -> int:
    from .replay import SUMMARY_KEYS, run_replay
    from .report import compare, console

    apply_quick(a)
    if a.workload == "trace" and a.limit is None and not a.full:
        a.limit = 400
    modes = expand_modes(a.mode)
    out = Path(a.out)
    dirs = []
    for mode in modes:
        d = out if len(modes) == 1 else out / mode
        console.print(f"[bold]replay[/bold] mode={mode} workload={a.workload} K={a.engines} P={a.prefill} -> {d}")
        s = asyncio.run(run_replay(run_spec_from_args(a, mode, d)))
        if a.label and len(modes) == 1:
            s["label"] = a.label
            (d / "summary.json").write_text(json.dumps(s, indent=2))
        console.print({k: s.get(k) for k in SUMMARY_KEYS})
        dirs.append(d)
    if len(dirs) > 1:
        compare(dirs, out, title=f"Routing modes: {a.workload}")
    return 0


def cmd_suite(a: argparse.Namespace) -> int:
    from .suite import run_suite

    return run_suite(a)


def cmd_fleet(a: argparse.Namespace) -> int:
    from .fleet_table import main as fleet_main

    return fleet_main(a)


def cmd_compare(a: argparse.Namespace) -> int:
    from .report import compare

    dirs = [Path(d) for d in a.dirs]
    compare(dirs, Path(a.out) if a.out else None)
    return 0


def cmd_sweep_threshold(a: argparse.Namespace) -> int:
    from .sweeps import sweep_threshold

    apply_quick(a)
    return sweep_threshold(a)


def cmd_load_sweep(a: argparse.Namespace) -> int:
    from .sweeps import load_sweep

    return load_sweep(a)


def cmd_offload_sweep(a: argparse.Namespace) -> int:
    from .sweeps import offload_sweep

    return offload_sweep(a)


def cmd_overhead(a: argparse.Namespace) -> int:
    from .overhead import main as overhead_main

    return overhead_main(a)


def cmd_scaling(a: argparse.Namespace) -> int:
    from .scaling import main as scaling_main

    return scaling_main(a)


def cmd_profile(a: argparse.Namespace) -> int:
    from .profile import main as profile_main

    return profile_main(a)


# Subcommands that are programs of their own, with their own flags: every argument after
# the name goes to the module's main().
FORWARDED = {
    "sim-capacity": "bench.sim_capacity",
    "soak": "bench.soak",
    "vllm-client": "bench.vllm_client",
    "slow-readers": "bench.slow_readers",
    "fairness": "bench.fairness",
    "engine-idle": "bench.engine_idle",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("replay", help="replay a workload through routing modes")
    add_workload_args(r)
    add_cluster_args(r)
    r.add_argument(
        "--mode",
        default="probe",
        help="probe | round_robin | least_loaded | prefix_tree | oracle | vllm_router_rr | "
        "vllm_router_cache_aware | smg_rr | smg_cache_aware, a comma list, or 'all' "
        "(each into OUT/<mode>)",
    )
    r.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router replicas in front of the same engines, requests round robin over them "
        "(bench/fleet.py; default %(default)s)",
    )
    r.add_argument(
        "--restart-engine-at",
        type=float,
        default=0.0,
        metavar="S",
        help="restart one decode engine S seconds into the run (its cache is lost); "
        "summary.json gets the hit ratio before and per 25 requests after",
    )
    r.add_argument("--out", required=True)
    r.add_argument("--label", help="name of the run in compare tables (default: the mode)")
    r.add_argument("--full", action="store_true", help="the whole trace (default: first 400 requests)")
    r.add_argument("--quick", action="store_true", help="a small run (trace: 150 requests)")
    r.set_defaults(fn=cmd_replay)

    su = sub.add_parser("suite", help="every routing mode on every suite workload: one regret table")
    add_cluster_args(su)
    su.add_argument("--out", required=True)
    su.add_argument("--quick", action="store_true", help="about a third of the requests of each workload")
    su.add_argument("--workloads", default="all", help="comma list of suite workloads (default: all)")
    su.add_argument(
        "--modes",
        default="oracle,probe,prefix_tree,least_loaded,round_robin",
        help="comma list of modes, run back to back on each workload (default: %(default)s)",
    )
    su.add_argument("--trace", help="Mooncake-format trace of the trace workloads (default: generated)")
    su.add_argument("--requests", type=int, default=0, help="about this many requests per workload (0: its own)")
    su.add_argument("--seed", type=int, default=0)
    su.set_defaults(fn=cmd_suite)

    c = sub.add_parser("compare", help="table and plots from run directories")
    c.add_argument("dirs", nargs="+")
    c.add_argument("--out", help="where compare.md and the PNGs go (default: parent of the first dir)")
    c.set_defaults(fn=cmd_compare)

    t = sub.add_parser("sweep-threshold", help="probe mode at several thresholds")
    add_workload_args(t)
    add_cluster_args(t)
    t.add_argument("--thresholds", default="0.1,0.3,0.5,0.7,0.9")
    t.add_argument("--out", required=True)
    t.add_argument("--quick", action="store_true")
    t.set_defaults(fn=cmd_sweep_threshold)

    ls = sub.add_parser("load-sweep", help="offered load from light to past capacity")
    add_workload_args(ls)
    add_cluster_args(ls)
    ls.add_argument("--rates", default="", help="offered loads (requests/s), comma list (default: by workload)")
    ls.add_argument(
        "--series",
        default="probe,probe-no-arrival-check,probe-no-deadline,least_loaded,prefix_tree",
        help="comma list of series",
    )
    ls.add_argument("--requests", type=int, default=0, help="requests per point (default: by workload)")
    ls.add_argument("--out", required=True)
    ls.add_argument("--quick", action="store_true")
    ls.add_argument("--skip-rejection", action="store_true", help="skip the rejection-latency test")
    ls.add_argument("--resume", action="store_true", help="keep points whose summary.json exists")
    # Shared-prefix groups on engines at 1/4 of an H100, so that "past capacity" is reached at
    # request rates this machine can drive.
    ls.set_defaults(fn=cmd_load_sweep, workload="prefix-groups", speed=0.25, output_tokens=32)

    o = sub.add_parser("overhead", help="latency and throughput the router adds over an instant backend")
    o.add_argument("--out", required=True)
    o.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median reported)")
    o.add_argument("--duration", type=float, default=4.0, help="seconds per throughput measurement")
    o.add_argument("--latency-requests", type=int, default=400, help="sequential requests per latency sample")
    o.add_argument("--connections", type=int, default=64)
    o.add_argument("--targets", default="", help="comma list (default: all available)")
    o.add_argument("--probe-k", default="2,4,8", help="engine counts for the probe-race cost")
    o.add_argument("--quick", action="store_true")
    o.add_argument("--no-pin", action="store_true")
    o.set_defaults(fn=cmd_overhead)

    of = sub.add_parser("offload-sweep", help="hit ratio and TTFT against each engine's CPU KV tier")
    add_workload_args(of)
    add_cluster_args(of)
    of.add_argument("--factors", default="0,2,4,8,16", help="CPU tier sizes, x GPU KV capacity")
    of.add_argument("--modes", default="probe,prefix_tree,round_robin")
    of.add_argument("--out", required=True)
    of.add_argument("--resume", action="store_true", help="keep runs whose summary.json exists")
    of.set_defaults(fn=cmd_offload_sweep)

    sc = sub.add_parser("scaling", help="router CPU and memory as K grows; 1,000 open streams")
    sc.add_argument("--out", required=True)
    sc.add_argument("--ks", default="2,4,8,16")
    sc.add_argument("--requests", type=int, default=400, help="requests per K")
    sc.add_argument("--streams", type=int, default=1000, help="open streams for the memory test")
    sc.add_argument("--quick", action="store_true")
    sc.set_defaults(fn=cmd_scaling)

    pr = sub.add_parser("profile", help="py-spy profile of the router under wrk load")
    pr.add_argument("--out", required=True)
    pr.add_argument("--strategy", default="round_robin")
    pr.add_argument("--k", type=int, default=1, help="backends (instant)")
    pr.add_argument("--stream", action="store_true")
    pr.add_argument("--connections", type=int, default=64)
    pr.add_argument("--duration", type=float, default=10.0)
    pr.add_argument("--log-level", default="info")
    pr.add_argument("--top", type=int, default=25)
    pr.set_defaults(fn=cmd_profile)

    fl = sub.add_parser("fleet", help="router replicas N = 1, 2, 4 on several workloads, one table")
    add_workload_args(fl)
    add_cluster_args(fl)
    fl.add_argument(
        "--workloads", default="prefix-groups,multiturn,trace", help="comma list of workloads (default %(default)s)"
    )
    fl.add_argument("--routers-list", default="1,2,4", help="replica counts (default %(default)s)")
    fl.add_argument(
        "--modes",
        default="probe,prefix_tree,vllm_router_cache_aware,smg_cache_aware",
        help="comma list; modes whose router is not installed are left out (default %(default)s)",
    )
    fl.add_argument(
        "--restart-engine-at",
        type=float,
        default=0.0,
        metavar="S",
        help="also run each mode at the largest N with one decode engine restarted S seconds in",
    )
    fl.add_argument("--resume", action="store_true", help="keep runs whose summary.json exists")
    fl.add_argument("--out", required=True)
    fl.set_defaults(fn=cmd_fleet)

    sub.add_parser("sim-capacity", help="the simulator's capacity (bench/sim_capacity.py; its own flags)")
    sub.add_parser("soak", help="steady load with periodic engine restarts (bench/soak.py; its own flags)")
    sub.add_parser(
        "vllm-client", help="vllm bench serve through the router and direct (bench/vllm_client.py; its own flags)"
    )
    sub.add_parser(
        "engine-idle", help="idle CPU and NIXL transfer time of real vLLM engines (bench/engine_idle.py; its own flags)"
    )
    return p


def _terminate(signum, frame) -> None:
    # SIGTERM unwinds like Ctrl-C, so every `finally` stops the processes this run started.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    import importlib
    import signal

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in FORWARDED:
        signal.signal(signal.SIGTERM, _terminate)
        return int(importlib.import_module(FORWARDED[argv[0]]).main(argv[1:]) or 0)
    a = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
