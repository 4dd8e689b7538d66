"""The vLLM metrics the router reads from an engine's `/metrics`, and their parser.

The load view reads the running and waiting request gauges and the KV cache usage; the
cost model reads the counters of prompt tokens served from each cache tier and the CPU
tier's load seconds, to learn what a cached token costs (router/routing/speed_learner.py).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# vLLM metrics the load view reads (gauges, summed over label sets).
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# Counters the cost model reads for what a cached token costs (a CPU-tier load or nothing).
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
HITS_DEVICE = CACHED_BY_SOURCE + ":device"  # GPU prefix-cache hit tokens
HITS_HOST = CACHED_BY_SOURCE + ":host"  # CPU-tier (OffloadingConnector) hit tokens
OFFLOAD_LOAD_TIME = "vllm:kv_offload_load_time"
# Engine cores the server's running-requests gauge names (vLLM labels each DP rank's
# samples engine="<rank>"): more than one is a data-parallel server.
ENGINE_CORES = "engine_cores"


def parse_load_metrics(text: str, engine: str | None = None) -> dict[str, float]:
    """Sum, over label sets, the gauges the load view uses from a Prometheus exposition,
    and the counters of hit tokens by cache tier (`HITS_DEVICE`, `HITS_HOST`) and of CPU-tier
    load seconds. With `engine`, only the samples of that engine core (vLLM's `engine`
    label: a DP rank's index), so each rank of a data-parallel server reads its own load."""
    wanted = (RUNNING, WAITING, KV_USAGE)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        samples = family.samples
        if engine is not None:
            samples = [s for s in samples if s.labels.get("engine", engine) == engine]
        if family.name in wanted:
            out[family.name] = out.get(family.name, 0.0) + sum(s.value for s in samples if s.name == family.name)
            if family.name == RUNNING:
                out[ENGINE_CORES] = float(len({s.labels.get("engine") for s in samples}))
        elif family.name == CACHED_BY_SOURCE:
            for s in samples:
                source = s.labels.get("source")
                if s.name == CACHED_BY_SOURCE + "_total" and source in ("device", "host"):
                    key = f"{CACHED_BY_SOURCE}:{source}"
                    out[key] = out.get(key, 0.0) + s.value
        elif family.name == OFFLOAD_LOAD_TIME:
            out[family.name] = sum(s.value for s in samples if s.name == family.name + "_total")
    return out
