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
import os
import platform
import time
from dataclasses import asdict
from typing import Any

import aiohttp

from bench.experiments.replay_summary import summarize
from bench.experiments.runspec import RunSpec
from bench.harness.cluster import Cluster, RouterOptions, counters_delta, engine_counters
from bench.harness.loadgen import run_open_loop, run_sessions
from bench.harness.modes import ALL_MODES, EXTERNAL_MODES, ORACLE, OUR_MODES, SMG_MODES, strategy_of
from bench.harness.procs import ProcessSet, RSSSampler, cpu_list
from bench.harness.replicas import Samplers, recovery, restart_engine_at, scrape_all, slow_engine_at, start_replicas
from bench.reports.rundir import load_requests, parse_router_log, write_outputs
from bench.workloads import generators as wl
from bench.workloads.spec import build_requests, build_sessions
from engine_launcher.sim import tokenizer as simtok

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


def machine_info() -> dict[str, Any]:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": len(cpu_list()),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def _pinning(spec: RunSpec) -> tuple[list[int] | None, list[int] | None]:
    """(router cores, everything-else cores): the router gets the last core to itself
    when there are at least 2 and pinning is on."""
    cores = cpu_list()
    if not spec.pin or len(cores) < 2:
        return None, None
    return [cores[-1]], cores[:-1]


async def run_replay(spec: RunSpec) -> dict[str, Any]:
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
    if spec.mode == ORACLE:
        if oracle is None:
            raise SystemExit(
                "oracle: the multi-turn oracle depends on the engines' answers; "
                "it is reported with every run of a mode instead"
            )
        assert reqs is not None  # the oracle is computed from reqs
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
                for r, h in zip(reqs, oracle["per_request"], strict=False)
            )
        )
        return summary

    router_cores, other_cores = _pinning(spec)
    own_affinity = os.sched_getaffinity(0)
    procs = ProcessSet(spec.out / "logs")
    cluster = Cluster(procs, [], [], decoders_prefill=spec.decoders_prefill)
    try:
        await cluster.start_engines(
            spec.engines,
            spec.prefill if spec.mode in OUR_MODES else 0,
            spec.sim,
            cores=other_cores,
            engines_per_process=spec.engines_per_process,
            extra_decoder=("--enable-admin",) if spec.slow_engine_at > 0 else (),
        )
        urls: list[str] | None = None
        if spec.routers > 1 or spec.mode in SMG_MODES:
            strategy = strategy_of(spec.mode) if spec.mode in OUR_MODES else "probe"
            urls = await start_replicas(
                cluster,
                spec.mode,
                spec.routers,
                RouterOptions(**{**asdict(spec.router), "strategy": strategy}),
                spec.out,
                cores=router_cores,
            )
        elif spec.mode in OUR_MODES:
            await cluster.start_router(
                RouterOptions(**{**asdict(spec.router), "strategy": strategy_of(spec.mode)}),
                spec.out,
                cores=router_cores,
            )
        elif spec.mode in EXTERNAL_MODES:
            await cluster.start_vllm_router(EXTERNAL_MODES[spec.mode], cores=router_cores)
        elif spec.mode == "direct":
            cluster.direct()
        else:
            raise SystemExit(f"unknown mode {spec.mode!r} (one of {', '.join(ALL_MODES)})")
        if other_cores is not None:  # _pinning gives both or neither
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
        slow = (
            asyncio.ensure_future(slow_engine_at(cluster, spec.slow_engine_at, spec.slowdown))
            if spec.slow_engine_at > 0
            else None
        )
        if sessions is not None:
            results, prompts, wall = await run_sessions(urls or cluster.url, sessions)
        else:
            assert reqs is not None  # built whenever there are no sessions
            results, wall = await run_open_loop(urls or cluster.url, reqs)
            prompts = None
        if restart is not None:
            base["restart"] = await restart
        if slow is not None:
            base["slowdown"] = await slow
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
        assert prompts is not None  # run_sessions returns them
        seqs = []
        for p, r in zip(prompts, results, strict=False):
            ids = simtok.encode(p)
            seqs.append((ids, simtok.encode(p + r.text) if r.ok else None))
        hits, total, per = wl.oracle_hit_tokens(seqs, block)
        oracle = {
            "oracle_hit_tokens": hits,
            "prompt_tokens": total,
            "oracle_hit_ratio": hits / total if total else 0.0,
            "per_request": per,
        }
        for r, p in zip(results, prompts, strict=False):
            r.expected_prompt_tokens = len(simtok.encode(p))
        base["workload"].update({"requests": len(results), "prompt_tokens": total})
    logs = {}
    if cluster.router_kind == "ours":
        for log_file in sorted((spec.out / "logs").glob("router*.log")):
            logs.update(parse_router_log(log_file))
    assert oracle is not None  # from reqs before the run, or from the sessions just above
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
