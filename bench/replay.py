"""One replay run: a workload through one routing mode in front of a fresh simulated cluster.

`run_replay(spec)` starts K decode and P prefill engines (subprocesses, cold caches), the
router of the mode (ours as `router --config gen.toml --no-engines`, or vllm-router), sends
the workload, scrapes every engine's and the router's /metrics before and after, samples the
router's CPU time and memory (psutil on its PID), and writes `summary.json`,
`requests.jsonl` and the router log into the output directory. Mode `oracle` runs nothing:
it writes the infinite-cache bound of the workload.

Hit ratio (docs/BENCHMARKS.md): prompt tokens served from a prefix cache on the engine that
computed the prompt, over all prompt tokens of the workload:
- a request answered by an engine that computed its prompt (route probe_hit or direct):
  the `cached_tokens` that engine reported in usage.prompt_tokens_details;
- a request that went prefill/decode (route pd): the producer computed the prompt; its hits
  are the producers' `vllm:prefix_cache_hits_total` plus their
  `vllm:external_prefix_cache_hits_total` (a producer pulls nothing over NIXL, so its
  connector hits are its own CPU tier's; producers serve nothing else);
- every other engine-side hit (a probe loser that started, the consumer's local blocks of a
  decode leg) is not a hit of the computing engine and is left out; the plain sum over
  engines is reported too, as `hit_ratio_engine_sum`.
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from engine_launcher.sim import tokenizer as simtok

from . import workloads as wl
from .cluster import (
    EXTERNAL_MODES,
    ROUTER_MODES,
    Cluster,
    RouterOptions,
    SimOptions,
    buckets_delta,
    counters_delta,
    engine_counters,
    histogram_buckets,
    histogram_quantile,
    metric_sum,
    sum_buckets,
)
from .fleet import SMG_MODES, Samplers, recovery, restart_engine_at, scrape_all, start_replicas
from .loadgen import Result, run_open_loop, run_sessions
from .procs import ProcessSet, RSSSampler, cpu_list
from .stats import mean, percentile, rnd

ALL_MODES = ROUTER_MODES + tuple(EXTERNAL_MODES) + tuple(SMG_MODES) + ("oracle",)
SUMMARY_KEYS = (
    "mode",
    "requests",
    "errors",
    "hit_ratio",
    "oracle_hit_ratio",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "e2e_p50_ms",
    "throughput_rps",
    "output_tokens_per_s",
    "probes_per_request",
    "loser_tokens",
    "router_cpu_s_per_1k",
    "router_rss_mb",
)


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

    @property
    def length_scale(self) -> float:
        return self.block_tokens / wl.TRACE_BLOCK if self.kind == "trace" else 1.0


@dataclass
class RunSpec:
    mode: str
    out: Path
    workload: WorkloadSpec
    engines: int = 4
    prefill: int = 1
    sim: SimOptions = field(default_factory=SimOptions)
    router: RouterOptions = field(default_factory=RouterOptions)
    slo_ttft_ms: float = 1000.0
    pin: bool = False
    quiet: bool = False
    engines_per_process: int = 1
    routers: int = 1  # router replicas; requests round robin over them (bench/fleet.py)
    restart_engine_at: float = 0.0  # > 0: restart one decode engine this many seconds in


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
        for r, t in zip(reqs, wl.poisson_arrivals(len(reqs), w.rate, w.seed)):
            r.arrival_s = t
    if w.burst_on_s > 0 and w.burst_off_s > 0 and len(reqs) > 1:
        span = reqs[-1].arrival_s - reqs[0].arrival_s
        for r, t in zip(reqs, wl.on_off_arrivals(len(reqs), len(reqs) / span, w.burst_on_s, w.burst_off_s, w.seed)):
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


def machine_info() -> dict:
    import os

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": len(cpu_list()),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def parse_router_log(path: Path) -> dict[str, dict]:
    """request id -> the router's per-request log record: a JSON line of logger
    cachehit_router.requests (server.log_format = "json", the default), or in the text
    format the JSON after the logger name."""
    out: dict[str, dict] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            if line.startswith("{"):
                d = json.loads(line)
                if d.get("logger") != "cachehit_router.requests":
                    continue
            else:
                i = line.find("cachehit_router.requests: ")
                if i < 0:
                    continue
                d = json.loads(line[i + len("cachehit_router.requests: ") :])
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("request_id"):
            out[d["request_id"]] = d
    return out


def _pinning(spec: RunSpec) -> tuple[list[int] | None, list[int] | None]:
    """(router cores, everything-else cores): the router gets the last core to itself
    when there are at least 2 and pinning is on."""
    cores = cpu_list()
    if not spec.pin or len(cores) < 2:
        return None, None
    return [cores[-1]], cores[:-1]


async def run_replay(spec: RunSpec) -> dict:
    spec.out.mkdir(parents=True, exist_ok=True)
    w = spec.workload
    block = spec.sim.block_size
    sessions = build_sessions(w) if w.kind == "multiturn" else None
    reqs = None if sessions is not None else build_requests(w)
    oracle = None
    if reqs is not None:
        oracle = wl.oracle_for_requests(reqs, block)
    base: dict[str, Any] = {
        "mode": spec.mode,
        "workload": {**asdict(w), **(wl.describe(reqs) if reqs is not None else {})},
        "engines": spec.engines,
        "prefill": spec.prefill,
        "sim": asdict(spec.sim),
        "router_options": asdict(spec.router),
        "machine": machine_info(),
        "routers": spec.routers,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if spec.mode == "oracle":
        if oracle is None:
            raise SystemExit(
                "oracle: the multi-turn oracle depends on the engines' answers; "
                "it is reported with every run of a mode instead"
            )
        summary = {
            **{k: None for k in SUMMARY_KEYS},
            **base,
            "requests": len(reqs),
            "errors": 0,
            "hit_ratio": oracle["oracle_hit_ratio"],
            "oracle_hit_ratio": oracle["oracle_hit_ratio"],
            "prompt_tokens": oracle["prompt_tokens"],
            "hit_tokens": oracle["oracle_hit_tokens"],
        }
        (spec.out / "summary.json").write_text(json.dumps(summary, indent=2))
        (spec.out / "requests.jsonl").write_text(
            "".join(
                json.dumps({"index": r.index, "prompt_tokens": r.prompt_tokens, "oracle_hit_tokens": h}) + "\n"
                for r, h in zip(reqs, oracle["per_request"])
            )
        )
        return summary

    router_cores, other_cores = _pinning(spec)
    import os

    own_affinity = os.sched_getaffinity(0)
    procs = ProcessSet(spec.out / "logs")
    cluster = Cluster(procs, [], [])
    try:
        await cluster.start_engines(
            spec.engines,
            spec.prefill if spec.mode in ROUTER_MODES else 0,
            spec.sim,
            cores=other_cores,
            engines_per_process=spec.engines_per_process,
        )
        urls: list[str] | None = None
        if spec.routers > 1 or spec.mode in SMG_MODES:
            strategy = spec.mode if spec.mode in ROUTER_MODES else "probe"
            urls = await start_replicas(
                cluster,
                spec.mode,
                spec.routers,
                RouterOptions(**{**asdict(spec.router), "strategy": strategy}),
                spec.out,
                cores=router_cores,
            )
        elif spec.mode in ROUTER_MODES:
            await cluster.start_router(
                RouterOptions(**{**asdict(spec.router), "strategy": spec.mode}), spec.out, cores=router_cores
            )
        elif spec.mode in EXTERNAL_MODES:
            await cluster.start_vllm_router(EXTERNAL_MODES[spec.mode], cores=router_cores)
        elif spec.mode == "direct":
            cluster.direct()
        else:
            raise SystemExit(f"unknown mode {spec.mode!r} (one of {', '.join(ALL_MODES)})")
        if router_cores is not None:
            # The load generator shares the engines' core(s); the router has its own.
            os.sched_setaffinity(0, other_cores)
        async with aiohttp.ClientSession() as s:
            eng_before = await engine_counters(s, cluster.engines)
            rm_before = await scrape_all(s, urls or [cluster.url]) if cluster.router_kind == "ours" else {}
        sampler = (
            (Samplers(cluster.replicas) if urls else RSSSampler(cluster.router.pid))
            if cluster.router is not None
            else None
        )
        if sampler:
            sampler.start()
        t_start = time.time()
        restart = (
            asyncio.ensure_future(restart_engine_at(cluster, spec.restart_engine_at))
            if spec.restart_engine_at > 0
            else None
        )
        if sessions is not None:
            results, prompts, wall = await run_sessions(urls or cluster.url, sessions)
        else:
            results, wall = await run_open_loop(urls or cluster.url, reqs)
            prompts = None
        if restart is not None:
            base["restart"] = await restart
        router_cpu, router_rss = (await sampler.stop()) if sampler else (None, None)
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as s:
            eng_after = await engine_counters(s, cluster.engines)
            rm_after = await scrape_all(s, urls or [cluster.url]) if cluster.router_kind == "ours" else {}
        decoders, prefillers = list(cluster.decoders), list(cluster.prefillers)
    finally:
        await cluster.stop()
        os.sched_setaffinity(0, own_affinity)
    eng = counters_delta(eng_before, eng_after)
    if sessions is not None:
        # Multi-turn oracle: every prompt and its answer, in send order.
        seqs = []
        for p, r in zip(prompts, results):
            ids = simtok.encode(p)
            seqs.append((ids, simtok.encode(p + r.text) if r.ok else None))
        hits, total, per = wl.oracle_hit_tokens(seqs, block)
        oracle = {
            "oracle_hit_tokens": hits,
            "prompt_tokens": total,
            "oracle_hit_ratio": hits / total if total else 0.0,
            "per_request": per,
        }
        for r, p in zip(results, prompts):
            r.expected_prompt_tokens = len(simtok.encode(p))
        base["workload"].update({"requests": len(results), "prompt_tokens": total})
    logs = {}
    if cluster.router_kind == "ours":
        for log_file in sorted((spec.out / "logs").glob("router*.log")):
            logs.update(parse_router_log(log_file))
    summary = summarize(
        spec, base, results, wall, eng, decoders, prefillers, rm_before, rm_after, logs, oracle, router_cpu, router_rss
    )
    summary["wall_clock_start"] = t_start
    summary["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    write_outputs(spec.out, summary, results, logs)
    if "restart" in base:
        summary["recovery"] = recovery(load_requests(spec.out), base["restart"]["down_at_s"])
        (spec.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summarize(
    spec: RunSpec,
    base: dict,
    results: list[Result],
    wall: float,
    eng: dict,
    decoders: list[str],
    prefillers: list[str],
    rm_before: dict,
    rm_after: dict,
    logs: dict,
    oracle: dict,
    router_cpu: float | None,
    router_rss: int | None,
) -> dict:
    ok = [r for r in results if r.ok]
    n = len(results)
    total_prompt = sum(r.expected_prompt_tokens or 0 for r in results)
    # Hit tokens on the computing engine (module docstring).
    routes: dict[str, int] = {}
    served_hits = 0
    for r in ok:
        route = (logs.get(r.response_id) or {}).get("route")
        if route is None:  # no router log: an external pull shows as cached == prompt
            route = (
                "pd"
                if (
                    r.cached_tokens is not None
                    and r.prompt_tokens
                    and r.cached_tokens >= r.prompt_tokens
                    and prefillers
                )
                else "direct"
            )
        routes[route] = routes.get(route, 0) + 1
        if route != "pd":
            served_hits += r.cached_tokens or 0
    # A prefill engine never pulls over NIXL: its connector hits are its own CPU tier's.
    producer_hits = sum(
        eng[u]["vllm:prefix_cache_hits_total"] + eng[u]["vllm:external_prefix_cache_hits_total"] for u in prefillers
    )
    hit_tokens = served_hits + producer_hits
    engine_sum = sum(d["vllm:prefix_cache_hits_total"] for d in eng.values())
    prefilled = sum(
        d["vllm:prefix_cache_queries_total"]
        - d["vllm:prefix_cache_hits_total"]
        - d["vllm:external_prefix_cache_hits_total"]
        for d in eng.values()
    )
    decoder_gen = sum(eng[u]["vllm:generation_tokens_total"] for u in decoders)
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    itl = [x for r in ok for x in r.itl_ms]
    e2e = [r.e2e_ms for r in ok]
    good = [r for r in ok if r.ttft_ms is not None and r.ttft_ms <= spec.slo_ttft_ms]
    s: dict[str, Any] = dict(base)
    s.update(
        {
            "requests": n,
            "errors": n - len(ok),
            "error_examples": sorted({r.error for r in results if not r.ok})[:5],
            "hit_ratio": rnd(hit_tokens / total_prompt if total_prompt else None, 4),
            "oracle_hit_ratio": rnd(oracle["oracle_hit_ratio"], 4) if oracle else None,
            "hit_tokens": int(hit_tokens),
            "prompt_tokens": total_prompt,
            "hit_ratio_engine_sum": rnd(engine_sum / total_prompt if total_prompt else None, 4),
            "prefilled_tokens": int(prefilled),
            "ttft_p50_ms": rnd(percentile(ttft, 50)),
            "ttft_p90_ms": rnd(percentile(ttft, 90)),
            "ttft_p99_ms": rnd(percentile(ttft, 99)),
            "ttft_mean_ms": rnd(mean(ttft)),
            "itl_p50_ms": rnd(percentile(itl, 50)),
            "itl_p99_ms": rnd(percentile(itl, 99)),
            "e2e_p50_ms": rnd(percentile(e2e, 50)),
            "e2e_p99_ms": rnd(percentile(e2e, 99)),
            "wall_s": rnd(wall),
            "offered_rps": base["workload"].get("offered_rps"),
            "throughput_rps": rnd(len(ok) / wall if wall else None),
            "output_tokens": out_tokens,
            "output_tokens_per_s": rnd(out_tokens / wall if wall else None, 1),
            "slo_ttft_ms": spec.slo_ttft_ms,
            "goodput_rps": rnd(len(good) / wall if wall else None),
            "goodput_fraction": rnd(len(good) / n if n else None, 4),
            "routes": routes,
            "engine_ttft_p50_ms": _q_ms(sum_buckets([eng[u].get("ttft_buckets", []) for u in decoders]), 0.5),
            "engine_ttft_p90_ms": _q_ms(sum_buckets([eng[u].get("ttft_buckets", []) for u in decoders]), 0.9),
            "engine_generated_tokens": int(decoder_gen),
            "engine_tokens_not_delivered": int(decoder_gen - out_tokens),
            "preemptions": int(sum(d["vllm:num_preemptions_total"] for d in eng.values())),
            "cpu_tier_hit_tokens": int(sum(d.get("cpu_tier_hit_tokens", 0) for d in eng.values())),
            "engine_rejections": int(sum(d["finished_cache_threshold"] for d in eng.values())),
            "router_cpu_s": rnd(router_cpu),
            "router_cpu_s_per_1k": rnd(router_cpu / n * 1000 if router_cpu is not None and n else None),
            "router_rss_mb": rnd(router_rss / 2**20 if router_rss else None, 1),
        }
    )
    # Router-side probe accounting.
    if rm_after:

        def d(name: str, **lab: str) -> float:
            return metric_sum(rm_after, name, **lab) - metric_sum(rm_before, name, **lab)

        rej = d("cachehit_router_probe_rejections_total")
        losers = d("cachehit_router_probe_losers_total")
        expired = d("cachehit_router_probe_deadline_expiries_total")
        hits_route = sum(
            d("cachehit_router_requests_total", route="probe_hit", status=st)
            for st in {lab.get("status") for lab, _ in rm_after.get("cachehit_router_requests_total", ())}
        )
        probes_metric = rej + losers + expired + hits_route if spec.mode == "probe" else 0.0
        probes_log = [x.get("probes", 0) for x in logs.values()]
        s["probes_per_request"] = rnd(
            (sum(probes_log) / len(probes_log)) if probes_log else (probes_metric / n if n else None)
        )
        s["probes_per_request_metrics"] = rnd(probes_metric / n if n else None)
        s["probe_rejections"] = int(rej)
        s["probe_losers"] = int(losers)
        s["probe_deadline_expiries"] = int(expired)
        s["loser_tokens"] = int(d("cachehit_router_probe_loser_tokens_total"))
        s["router_routes"] = {
            route: int(
                sum(
                    d("cachehit_router_requests_total", route=route, status=st)
                    for st in {lab.get("status") for lab, _ in rm_after.get("cachehit_router_requests_total", ())}
                )
            )
            for route in ("probe_hit", "pd", "direct")
        }
        for verdict in ("rejected", "expired", "accepted"):
            b = buckets_delta(
                histogram_buckets(rm_before, "cachehit_router_probe_verdict_seconds", verdict=verdict),
                histogram_buckets(rm_after, "cachehit_router_probe_verdict_seconds", verdict=verdict),
            )
            for q in (50, 99):
                v = histogram_quantile(b, q / 100)
                s[f"probe_{verdict}_p{q}_ms"] = rnd(v * 1000 if v is not None else None)
        pd_ttft = [
            r.ttft_ms for r in ok if (logs.get(r.response_id) or {}).get("route") == "pd" and r.ttft_ms is not None
        ]
        s["ttft_pd_p50_ms"] = rnd(percentile(pd_ttft, 50))
        s["ttft_pd_p99_ms"] = rnd(percentile(pd_ttft, 99))
    else:
        s.update({"probes_per_request": 0.0 if spec.mode not in ("probe",) else None, "loser_tokens": 0})
    s["loser_tokens_pct_of_output"] = rnd(100.0 * s["loser_tokens"] / out_tokens if out_tokens else None, 4)
    return s


def _q_ms(buckets: list, q: float) -> float | None:
    v = histogram_quantile(buckets, q)
    return rnd(v * 1000, 1) if v is not None else None


def write_outputs(out: Path, summary: dict, results: list[Result], logs: dict) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    with open(out / "requests.jsonl", "wb") as f:
        for r in results:
            row = r.row()
            lg = logs.get(r.response_id)
            if lg:
                row.update(
                    {
                        "route": lg.get("route"),
                        "winner": lg.get("winner"),
                        "prefill": lg.get("prefill"),
                        "probes": lg.get("probes"),
                        "rejections": lg.get("rejections"),
                        "losers": lg.get("losers"),
                        "expired": lg.get("expired"),
                        "router_ttft_ms": lg.get("ttft_ms"),
                        # the routing cost model's TTFT prediction for the leg that answered
                        "predicted_ttft_ms": lg.get("predicted_ttft_ms"),
                        # probe hits: the predicted TTFT of the best engine computing the whole prompt
                        "scratch_ttft_ms": lg.get("scratch_ttft_ms"),
                    }
                )
            f.write(orjson.dumps(row) + b"\n")


def load_summary(d: Path) -> dict:
    return json.loads((Path(d) / "summary.json").read_text())


def load_requests(d: Path) -> list[dict]:
    p = Path(d) / "requests.jsonl"
    if not p.exists():
        return []
    return [orjson.loads(line) for line in p.read_bytes().splitlines() if line.strip()]
