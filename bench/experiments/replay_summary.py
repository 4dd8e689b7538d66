"""A replay run's summary.json from what it measured: the client's results, the engines'
and the router's metrics before and after, the router's request log (hit ratio as
defined in experiments/replay.py's docstring)."""

from __future__ import annotations

from typing import Any

from bench.experiments.runspec import RunSpec
from bench.harness.cluster import buckets_delta, histogram_buckets, histogram_quantile, metric_sum, sum_buckets
from bench.harness.loadgen import Result
from bench.harness.stats import mean, percentile, rnd
from engine_launcher.sim.config import TimingModel


def summarize(
    spec: RunSpec,
    base: dict[str, Any],
    results: list[Result],
    wall: float,
    eng: dict[str, Any],
    decoders: list[str],
    prefillers: list[str],
    rm_before: dict[str, Any],
    rm_after: dict[str, Any],
    logs: dict[str, Any],
    oracle: dict[str, Any],
    router_cpu: float | None,
    router_rss: int | None,
) -> dict[str, Any]:
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
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    good_ttft = [r for r in ok if r.ttft_ms is not None and r.ttft_ms <= spec.slo_ttft_ms]
    # DistServe's goodput: both SLOs; a request's ITL is its longest gap (a stall is seen).
    good = [r for r in good_ttft if max(r.itl_ms, default=0.0) <= spec.slo_itl_ms]
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
            "slo_itl_ms": spec.slo_itl_ms,
            "goodput_rps": rnd(len(good) / wall if wall else None),
            "goodput_fraction": rnd(len(good) / n if n else None, 4),
            "goodput_ttft_fraction": rnd(len(good_ttft) / n if n else None, 4),
            "producer_utilisation": producer_utilisation(spec, eng, prefillers, wall),
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
        # Sequences the engines' KV events showed that the router (each replica) did not send:
        # other replicas'; with one router, chains its own legs began and it failed to claim.
        s["others_sequences_seen"] = int(d("cachehit_router_kv_events_others_sequences"))
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


def _q_ms(buckets: list[tuple[float, float]], q: float) -> float | None:
    v = histogram_quantile(buckets, q)
    return rnd(v * 1000, 1) if v is not None else None


def producer_utilisation(spec: RunSpec, eng: dict[str, Any], prefillers: list[str], wall: float) -> float | None:
    """Share of the run's wall time the prefill engines spent prefilling: the prompt tokens
    they computed (not hits) at the simulator's cost per token, over their number."""
    if not prefillers or wall <= 0:
        return None
    per_token = (spec.sim.prefill_token_s or TimingModel().prefill_token_s) / spec.sim.speed
    computed = sum(
        eng[u]["vllm:prompt_tokens_total"]
        - eng[u]["vllm:prefix_cache_hits_total"]
        - eng[u]["vllm:external_prefix_cache_hits_total"]
        for u in prefillers
    )
    return rnd(max(computed, 0.0) * per_token / wall / len(prefillers), 4)
