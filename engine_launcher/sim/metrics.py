"""Prometheus metrics under vLLM 0.32's names and labels (vllm/v1/metrics/loggers.py).

Each engine has its own `CollectorRegistry`, so several engines share a process. Labels are
vLLM's: `model_name` (the served model name) and `engine` (the engine index, "0"), plus
`finished_reason` on `vllm:request_success_total`. A threshold rejection is counted under
`finished_reason="cache_threshold"`, the string the threshold plugin renders for its finish
reason, and also in the plugin's `cachehit_threshold_rejections_total{stage}`. NIXL counters
use vLLM's NIXL connector names (nixl/stats.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vllm/v1/metrics/buckets.py TIME_TO_FIRST_TOKEN_BUCKETS
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
# REQUEST_LATENCY_BUCKETS (e2e and queue time)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition", "cache_threshold")


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        block_size: int,
        num_gpu_blocks: int,
        enable_prefix_caching: bool,
        cpu_offload: bool = False,
        engine_index: int = 0,
    ) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = (model_name, str(engine_index))

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*labels, "reason"],
            registry=r,
        )
        self.waiting_capacity = waiting_by_reason.labels(*values, "capacity")
        self.waiting_deferred = waiting_by_reason.labels(*values, "deferred")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [*labels, "source"], registry=r
        )
        self.prompt_tokens_local_compute = by_source.labels(*values, "local_compute")
        self.prompt_tokens_local_cache_hit = by_source.labels(*values, "local_cache_hit")
        self.prompt_tokens_external = by_source.labels(*values, "external_kv_transfer")
        # vLLM 0.32 (v1/metrics/loggers.py): hits by the tier that supplied them, counted at
        # admission; device = GPU prefix cache, host = CPU tier, p2p = NIXL.
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            [*labels, "source"],
            registry=r,
        )
        self.cached_by_source = {
            source: cached_by_source.labels(*values, source)
            for source in ("device", "host", "p2p", "disk", "external_unspecified")
        }
        if cpu_offload:
            # The OffloadingConnector's counters (offloading/metrics.py), only with a CPU tier.
            self.offload_load_bytes = counter(
                "vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU."
            )
            self.offload_load_time = counter(
                "vllm:kv_offload_load_time", "Total load time from offload storage to GPU, in seconds."
            )
            self.offload_store_bytes = counter(
                "vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage."
            )
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.request_success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(*values)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        ).labels(*values)
        self.request_queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        ).labels(*values)
        self.nixl_num_failed_transfers = counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers."
        )
        self.nixl_num_kv_expired_reqs = counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
        )
        # The threshold plugin's own counter (engine_launcher/vllm_plugin/stream_patch.py),
        # same name, help and label.
        rejections = Counter(
            "cachehit_threshold_rejections",
            "Requests finished with finish_reason cache_threshold, by stage: arrival (engine "
            "core add_request), admission (scheduler, first admission), readmission "
            "(scheduler, after a preemption).",
            ["stage"],
            registry=r,
        )
        self.threshold_rejections = {
            stage: rejections.labels(stage) for stage in ("arrival", "admission", "readmission")
        }
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"],
            registry=r,
        )
        info.labels(str(block_size), str(enable_prefix_caching), str(num_gpu_blocks), str(engine_index)).set(1)

    def offload_loaded(self, num_bytes: int, seconds: float) -> None:
        self.offload_load_bytes.inc(num_bytes)
        self.offload_load_time.inc(seconds)

    def offload_stored(self, num_bytes: int) -> None:
        self.offload_store_bytes.inc(num_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
