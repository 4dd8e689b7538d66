"""The routing suite's workloads: each one a replay of traffic that catches some routing policy out.

`SuiteWorkload.breaks` says which policy, and why; `bench/experiments/suite.py` runs them
(every mode on each) and docs/BENCHMARKS.md describes them for readers of the table.
"""

from __future__ import annotations

from dataclasses import dataclass

TRACE_HEAD = ("--workload", "trace", "--window", "head", "--limit", "400")
TRACE_SPEED = 0.3  # engines at 0.3 of an H100: ~6 requests/s at utilisation 0.85 on K = 4
# GPU KV of the cpu-tier workload: 8k tokens per engine, a fraction of what 400 requests of the
# trace leave behind, so turns come back after eviction (the trace's prompts are scaled
# down 16x from the trace's token counts; 28,000 blocks / 16 would be 1,750); the CPU tier
# is 8x that.
CPU_TIER_GPU_BLOCKS = 500
# GPU KV of the many-tenants workload: about 50 of the 150 prompts of 1,564 tokens per
# engine (16-token blocks).
MANY_TENANTS_GPU_BLOCKS = 5000


@dataclass(frozen=True)
class SuiteWorkload:
    name: str
    breaks: str  # the routing policy this workload is there to catch out
    flags: tuple[str, ...]  # `replay` workload flags
    quick_flags: tuple[str, ...] = ()  # added with --quick (about a third of the requests)
    speed: float = 1.0  # simulator speed unless --speed is given
    target: float | None = None  # utilisation the arrival rate is set for (None: the workload's own)
    bursts: tuple[float, float] | None = None  # (on s, off s): re-timed into bursts after the rate is set
    # Cluster settings of this workload ((replay attribute, value)), used where the suite's
    # own flag is left at its default.
    cluster: tuple[tuple[str, float | str], ...] = ()


WORKLOADS: tuple[SuiteWorkload, ...] = (
    SuiteWorkload(
        "low-reuse",
        "probe's P/D fallback and prefix_tree: little to hit, so load balance decides",
        TRACE_HEAD,
        ("--limit", "130"),
        TRACE_SPEED,
        target=0.85,
    ),
    SuiteWorkload(
        "prefix-groups",
        "round_robin and least_loaded: they scatter each group's prefix",
        ("--workload", "prefix-groups", "--rate", "8"),
        ("--per-group", "8"),
    ),
    SuiteWorkload(
        "multiturn",
        "cache-blind policies: each turn extends the previous turn's cached prompt",
        ("--workload", "multiturn"),
        ("--sessions", "6"),
    ),
    SuiteWorkload(
        "hetero",
        "least_loaded and round_robin: requests are not work; long prompts block short ones",
        (
            "--workload",
            "hetero",
            "--limit",
            "400",
            "--rate",
            "8",
            "--min-prompt-tokens",
            "32",
            "--max-prompt-tokens",
            "8000",
            "--output-tokens",
            "64",
        ),
        ("--limit", "130"),
        0.15,
        target=0.85,
    ),
    SuiteWorkload(
        "bursty",
        "load signals that lag: a burst lands before the queues show it",
        TRACE_HEAD,
        ("--limit", "130"),
        TRACE_SPEED,
        target=0.85,
        bursts=(2.0, 6.0),
    ),
    SuiteWorkload(
        "overload",
        "anything that piles onto one engine or into P/D when every queue grows",
        TRACE_HEAD,
        ("--limit", "130"),
        TRACE_SPEED,
        target=1.2,
    ),
    SuiteWorkload(
        "real-arrivals",
        "load predictions on measured-like traffic: clustered arrivals (gamma gaps, cv 3) and "
        "answers 4x the trace's (a long tail of decodes) at 85% of capacity",
        (*TRACE_HEAD, "--arrival-cv", "3", "--output-scale", "4"),
        ("--limit", "160"),
        TRACE_SPEED,
        target=0.85,
    ),
    SuiteWorkload(
        "cpu-tier",
        "routers that only know what they sent or what the GPU holds: a conversation's "
        "next turn returns after its blocks left the GPU for one engine's CPU tier",
        TRACE_HEAD,
        ("--limit", "130"),
        TRACE_SPEED,
        target=0.85,
        cluster=(("num_gpu_blocks", CPU_TIER_GPU_BLOCKS), ("cpu_offload_x", 8.0)),
    ),
    SuiteWorkload(
        "ample-producers",
        "goodput's triage where producers idle: four of them, enough to prefill every prompt "
        "(~0.8 of their capacity if all were split), beside the decoders at 85%; a prompt late "
        "wherever it goes should not queue on a decoder while a producer stands free",
        TRACE_HEAD,
        ("--limit", "130"),
        TRACE_SPEED,
        target=0.85,
        cluster=(("prefill", 4),),
    ),
    SuiteWorkload(
        "mixed-speed",
        "policies that take engines to be alike (round robin's equal shares, a fleet-wide speed): "
        "one decoder of four runs at half the others' speed, as an older GPU beside new ones, at "
        "85% of the fleet's capacity (3.5 engines' worth), and the router is not told",
        TRACE_HEAD,
        ("--limit", "130"),
        TRACE_SPEED,
        target=0.85,
        cluster=(("decoder_speed_factors", "0.5"),),
    ),
    SuiteWorkload(
        "noisy-neighbour",
        "a speed learned once: 8 s in, one decoder of four starts taking twice as long a step "
        "(another tenant on its GPU), the traffic at 85% of the four engines' capacity as before",
        TRACE_HEAD,
        ("--limit", "130"),
        TRACE_SPEED,
        target=0.85,
        cluster=(("slow_engine_at", 8.0),),
    ),
    SuiteWorkload(
        "many-tenants",
        "approximate indexes and races spent where the answer is known: 150 shared 1,500-token "
        "system prompts, 5 questions each, at 40 requests/s, engines that each hold about a third",
        (
            "--workload",
            "prefix-groups",
            "--groups",
            "150",
            "--per-group",
            "5",
            "--system-tokens",
            "1500",
            "--rate",
            "40",
        ),
        ("--groups", "60"),
        cluster=(("num_gpu_blocks", MANY_TENANTS_GPU_BLOCKS),),
    ),
    SuiteWorkload(
        "new-prefix-bursts",
        "an index fed by events: a burst of requests sharing a prefix nobody computed yet "
        "arrives before the first one's blocks are stored and announced",
        ("--workload", "prefix-groups", "--groups", "40", "--per-group", "8", "--rate", "24"),
        ("--groups", "16"),
        bursts=(1.0, 3.0),
    ),
    SuiteWorkload(
        "replicas",
        "one router's memory: four replicas behind a round-robin balancer share the engines",
        ("--workload", "prefix-groups", "--rate", "8"),
        ("--per-group", "8"),
        cluster=(("routers", 4),),
    ),
    SuiteWorkload(
        "engine-restart",
        "a view that misses a restart: one decoder restarts, its cache gone, mid-run",
        ("--workload", "prefix-groups", "--rate", "8"),
        ("--per-group", "8"),
        cluster=(("restart_engine_at", 12.0),),
    ),
)
BY_NAME = {w.name: w for w in WORKLOADS}
