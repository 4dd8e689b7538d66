"""What a benchmark run sends: a workload described by its parameters (`WorkloadSpec`, as
`replay`'s workload flags set them) and the requests or sessions it makes."""

from __future__ import annotations

from dataclasses import dataclass

from bench.workloads import generators as wl


@dataclass
class WorkloadSpec:
    kind: str = "trace"  # trace | prefix-groups | multiturn | hetero
    trace: str = ""
    limit: int | None = None
    offset: int = 0
    window: str = "head"  # head: `limit` requests from `offset`; tail: the last `limit` requests
    time_scale: float = 0.25
    block_tokens: int = 32
    output_scale: float = 1.0
    max_output: int = 0
    rate: float = 0.0  # > 0: Poisson arrivals at this rate instead of the trace's times
    seed: int = 0
    # prefix-groups
    groups: int = 12
    per_group: int = 24
    system_tokens: int = 2048
    question_tokens: int = 64
    output_tokens: int = 64
    # multiturn
    sessions: int = 16
    turns: int = 6
    message_tokens: int = 64
    think_s: float = 0.5
    # hetero: `limit` (default 400) prompts of log-uniform lengths in [min, max] tokens
    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 8000
    # both > 0: arrivals re-timed into bursts at the same mean rate (workloads.on_off_arrivals)
    burst_on_s: float = 0.0
    burst_off_s: float = 0.0
    # > 0: arrivals re-timed as a gamma renewal process with this coefficient of variation at
    # the same mean rate (workloads.gamma_arrivals): clustered, as measured arrivals are.
    arrival_cv: float = 0.0

    @property
    def length_scale(self) -> float:
        return self.block_tokens / wl.TRACE_BLOCK if self.kind == "trace" else 1.0


def build_requests(w: WorkloadSpec) -> list[wl.BenchRequest]:
    if w.kind == "trace":
        if w.window == "tail":
            records = wl.load_trace(w.trace)
            records = records[-w.limit :] if w.limit else records
        else:
            records = wl.load_trace(w.trace, None if w.limit is None else w.offset + w.limit)[w.offset :]
        reqs = wl.mooncake_requests(
            records,
            block_tokens=w.block_tokens,
            time_scale=w.time_scale,
            output_scale=w.output_scale,
            max_output=w.max_output,
            seed=w.seed,
        )
    elif w.kind == "prefix-groups":
        reqs = wl.prefix_group_requests(
            groups=w.groups,
            per_group=w.per_group,
            system_tokens=w.system_tokens,
            question_tokens=w.question_tokens,
            output_tokens=w.output_tokens,
            rate=w.rate or 8.0,
            seed=w.seed,
        )
        if w.limit:
            reqs = reqs[: w.limit]
    elif w.kind == "hetero":
        reqs = wl.heterogeneous_requests(
            n=w.limit or 400,
            min_tokens=w.min_prompt_tokens,
            max_tokens=w.max_prompt_tokens,
            output_tokens=w.output_tokens,
            rate=w.rate or 8.0,
            seed=w.seed,
        )
    else:
        raise ValueError(f"no request list for workload {w.kind!r}")
    if w.rate > 0 and w.kind == "trace":
        for r, t in zip(reqs, wl.poisson_arrivals(len(reqs), w.rate, w.seed), strict=False):
            r.arrival_s = t
    if w.burst_on_s > 0 and w.burst_off_s > 0 and len(reqs) > 1:
        span = reqs[-1].arrival_s - reqs[0].arrival_s
        for r, t in zip(
            reqs, wl.on_off_arrivals(len(reqs), len(reqs) / span, w.burst_on_s, w.burst_off_s, w.seed), strict=False
        ):
            r.arrival_s = t
    if w.arrival_cv > 0 and len(reqs) > 1:
        span = reqs[-1].arrival_s - reqs[0].arrival_s
        for r, t in zip(reqs, wl.gamma_arrivals(len(reqs), len(reqs) / span, w.arrival_cv, w.seed), strict=False):
            r.arrival_s = t
    return reqs


def build_sessions(w: WorkloadSpec) -> list[wl.Session]:
    return wl.multiturn_sessions(
        sessions=w.sessions,
        turns=w.turns,
        system_tokens=w.system_tokens,
        message_tokens=w.message_tokens,
        output_tokens=w.output_tokens,
        rate=w.rate or 1.0,
        think_s=w.think_s,
        seed=w.seed,
    )
