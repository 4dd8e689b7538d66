"""`python -m bench <subcommand>`: the benchmark suite (docs/BENCHMARKS.md).

replay           a workload through one or more routing modes (summary.json, requests.jsonl)
compare          one table and PNG plots from run directories
sweep-threshold  probe mode at T = 0.1 .. 0.9
load-sweep       offered load from light to past capacity; rejection latency on a full engine
offload-sweep    hit ratio and TTFT against each engine's CPU KV tier (F x its GPU capacity)
overhead         latency and throughput the router adds over an instant backend
scaling          router CPU and memory as K grows, and with 1,000 open streams
kv-events-cpu    router CPU per KV-event batch of one engine's stream
stream-instructions  instructions per streamed request under callgrind: A/B on a noisy machine
profile          py-spy profile of the router under load (hot functions)
sim-capacity     the simulator's own capacity (bench/experiments/sim_capacity.py)
soak             a long steady load with engine restarts (bench/experiments/soak.py)
suite            every routing mode on every suite workload: one regret table (bench/experiments/suite.py)
slow-readers     router memory under streams whose clients never read (bench/experiments/slow_readers.py)
fairness         one tenant's TTFT while another floods the router past its limits (bench/experiments/fairness.py)
engine-idle      idle CPU and NIXL transfer time of real vLLM engines (bench/experiments/engine_idle.py)
fleet            router replicas N = 1, 2, 4 on several workloads, one table (bench/experiments/fleet.py)
prefix-memory    the prefix memory's bytes at its cap; a tenant's flood (bench/experiments/prefix_memory.py)
limits           router memory with every slot holding a maximal body; unfinished request heads (bench/experiments/limits.py)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import signal
import sys
from pathlib import Path
from types import FrameType

from bench.experiments.load_sweep import DEFAULT_SERIES as LOAD_SWEEP_SERIES
from bench.experiments.options import (
    add_cluster_args,
    add_replay_args,
    add_workload_args,
    apply_quick,
    expand_modes,
    run_spec_from_args,
)
from bench.harness.modes import SUITE_MODES

# Each command imports its experiment when it runs, so `--help` and the forwarded programs
# start without every other experiment's dependencies.


def cmd_replay(a: argparse.Namespace) -> int:
    from bench.experiments.replay import SUMMARY_KEYS, run_replay
    from bench.reports.render import compare, console

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
    from bench.experiments.suite import run_suite

    return run_suite(a)


def cmd_fleet(a: argparse.Namespace) -> int:
    from bench.experiments.fleet import main as fleet_main

    return fleet_main(a)


def cmd_compare(a: argparse.Namespace) -> int:
    from bench.reports.render import compare

    dirs = [Path(d) for d in a.dirs]
    compare(dirs, Path(a.out) if a.out else None)
    return 0


def cmd_sweep_threshold(a: argparse.Namespace) -> int:
    from bench.experiments.threshold_sweep import sweep_threshold

    apply_quick(a)
    return sweep_threshold(a)


def cmd_load_sweep(a: argparse.Namespace) -> int:
    from bench.experiments.load_sweep import load_sweep

    return load_sweep(a)


def cmd_offload_sweep(a: argparse.Namespace) -> int:
    from bench.experiments.offload_sweep import offload_sweep

    return offload_sweep(a)


def cmd_overhead(a: argparse.Namespace) -> int:
    from bench.experiments.overhead import main as overhead_main

    return overhead_main(a)


def cmd_kv_events_cpu(a: argparse.Namespace) -> int:
    from bench.experiments.kv_events_cpu import main as kv_events_cpu_main

    return kv_events_cpu_main(a)


def cmd_stream_instructions(a: argparse.Namespace) -> int:
    from bench.experiments.stream_instructions import main as stream_instructions_main

    return stream_instructions_main(a)


def cmd_scaling(a: argparse.Namespace) -> int:
    from bench.experiments.scaling import main as scaling_main

    return scaling_main(a)


def cmd_profile(a: argparse.Namespace) -> int:
    from bench.experiments.profile import main as profile_main

    return profile_main(a)


# Subcommands that are programs of their own, with their own flags: every argument after
# the name goes to the module's main().
FORWARDED = {
    "sim-capacity": "bench.experiments.sim_capacity",
    "soak": "bench.experiments.soak",
    "vllm-client": "bench.experiments.vllm_client",
    "slow-readers": "bench.experiments.slow_readers",
    "fairness": "bench.experiments.fairness",
    "engine-idle": "bench.experiments.engine_idle",
    "prefix-memory": "bench.experiments.prefix_memory",
    "limits": "bench.experiments.limits",
    "reuse-port": "bench.experiments.reuse_port",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("replay", help="replay a workload through routing modes")
    add_replay_args(r)
    r.set_defaults(fn=cmd_replay)

    su = sub.add_parser("suite", help="every routing mode on every suite workload: one regret table")
    add_cluster_args(su)
    su.add_argument("--out", required=True)
    su.add_argument("--quick", action="store_true", help="about a third of the requests of each workload")
    su.add_argument("--workloads", default="all", help="comma list of suite workloads (default: all)")
    su.add_argument(
        "--modes",
        default=",".join(SUITE_MODES),
        help="comma list of modes, run back to back on each workload (default: %(default)s)",
    )
    su.add_argument("--trace", help="Mooncake-format trace of the trace workloads (default: generated)")
    su.add_argument("--requests", type=int, default=0, help="about this many requests per workload (0: its own)")
    su.add_argument("--seed", type=int, default=0)
    su.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="N rounds per workload, every mode once per round on the same trace, the order reversed "
        "every other round; medians and per-round paired ratios (default %(default)s: one run each)",
    )
    su.add_argument(
        "--control",
        metavar="MODE",
        help="with --repeat: MODE runs twice per round, the second as MODE~control (an A/A pair: the noise floor)",
    )
    su.add_argument(
        "--reference",
        metavar="MODE",
        help="with --repeat: the mode the others are paired against (default: probe if it runs, else the first)",
    )
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
        default=LOAD_SWEEP_SERIES,
        help="comma list of series, or 'goodput': probe with split auto/always/never and the baselines",
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
    o.add_argument("--streams", default="", help="e.g. 16,256,1024: CPU per streamed request and chunk instead")
    o.add_argument("--stream-shapes", default="instant,paced,burst", help="with --streams: how the chunks arrive")
    o.add_argument("--stream-chunks", type=int, default=65536, help="with --streams: chunks per measurement")
    o.add_argument("--stream-concurrency", type=int, default=16, help="with --streams: paced streams at once")
    o.add_argument(
        "--stream-rounds", type=int, default=1, help="with --streams: every target measured N times, alternated"
    )
    o.add_argument(
        "--base-checkout",
        default="",
        metavar="DIR",
        help="with --streams: each router target also started from this checkout (NAME@base), measured beside it",
    )
    o.add_argument(
        "--profile",
        nargs="?",
        const="paced:256",
        default=None,
        metavar="SHAPE:CHUNKS",
        help="with --streams: py-spy (else cProfile) of the router per chunk, on such streams (default paced:256)",
    )
    o.set_defaults(fn=cmd_overhead)

    of = sub.add_parser("offload-sweep", help="hit ratio and TTFT against each engine's CPU KV tier")
    add_workload_args(of)
    add_cluster_args(of)
    of.add_argument("--factors", default="0,2,4,8,16", help="CPU tier sizes, x GPU KV capacity")
    of.add_argument("--modes", default="probe,kv_events,prefix_tree,round_robin")
    of.add_argument("--out", required=True)
    of.add_argument("--resume", action="store_true", help="keep runs whose summary.json exists")
    of.set_defaults(fn=cmd_offload_sweep)

    sc = sub.add_parser("scaling", help="router CPU and memory as K grows; 1,000 open streams")
    sc.add_argument("--out", required=True)
    sc.add_argument("--ks", default="2,4,8,16")
    sc.add_argument("--requests", type=int, default=400, help="requests per K")
    sc.add_argument("--streams", type=int, default=1000, help="open streams for the memory test")
    sc.add_argument("--quick", action="store_true")
    sc.add_argument("--idle-s", type=float, default=20.0, help="seconds of the no-traffic CPU measure per K")
    sc.add_argument("--idle-only", action="store_true", help="only the no-traffic CPU measure")
    sc.set_defaults(fn=cmd_scaling)

    kc = sub.add_parser("kv-events-cpu", help="router CPU per KV-event batch of one engine's stream")
    kc.add_argument("--out", required=True)
    kc.add_argument("--batches", type=int, default=5000, help="batches per measurement")
    kc.add_argument("--rate", type=float, default=500.0, help="batches per second")
    kc.add_argument("--reps", type=int, default=3)
    kc.set_defaults(fn=cmd_kv_events_cpu)

    si = sub.add_parser(
        "stream-instructions", help="instructions per streamed request under callgrind: A/B on a noisy machine"
    )
    si.add_argument("--out", required=True)
    si.add_argument("--targets", default="passthrough,router_round_robin,router_probe_k4")
    si.add_argument("--streams", default="16,256", help="stream lengths (chunks)")
    si.add_argument("--stream-shapes", default="instant", help="how the chunks arrive (as overhead --streams)")
    si.add_argument("--requests", type=int, default=300, help="requests counted per figure")
    si.add_argument("--base-checkout", default="", metavar="DIR", help="each router target also from DIR (NAME@base)")
    si.set_defaults(fn=cmd_stream_instructions)

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
        default="probe,kv_events,prefix_tree,vllm_router_cache_aware,smg_cache_aware",
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

    sub.add_parser("sim-capacity", help="the simulator's capacity (bench/experiments/sim_capacity.py; its own flags)")
    sub.add_parser("soak", help="steady load with periodic engine restarts (bench/experiments/soak.py; its own flags)")
    sub.add_parser(
        "vllm-client",
        help="vllm bench serve through the router and direct (bench/experiments/vllm_client.py; its own flags)",
    )
    sub.add_parser("prefix-memory", help="the prefix memory's bytes at its cap (bench/experiments/prefix_memory.py)")
    sub.add_parser(
        "engine-idle",
        help="idle CPU and NIXL transfer time of real vLLM engines (bench/experiments/engine_idle.py; its own flags)",
    )
    sub.add_parser(
        "reuse-port",
        help="N router processes on one port (server.reuse_port): requests/s, CPU per request, spread (bench/experiments/reuse_port.py)",
    )
    sub.add_parser(
        "limits",
        help="router memory with every slot holding a maximal body; unfinished heads (bench/experiments/limits.py; its own flags)",
    )
    return p


def _terminate(signum: int, frame: FrameType | None) -> None:
    # SIGTERM unwinds like Ctrl-C, so every `finally` stops the processes this run started.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in FORWARDED:
        signal.signal(signal.SIGTERM, _terminate)
        return int(importlib.import_module(FORWARDED[argv[0]]).main(argv[1:]) or 0)
    a = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    return int(a.fn(a))
