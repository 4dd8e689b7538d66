"""The engine metrics the router scrapes (router/engine/scrape.py)."""

from __future__ import annotations

from router.engine.scrape import ENGINE_CORES, parse_load_metrics


def test_parse_load_metrics_sums_label_sets() -> None:
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 99.0
"""
    assert parse_load_metrics(text) == {
        "vllm:num_requests_running": 5.0,
        "vllm:num_requests_waiting": 7.0,
        "vllm:kv_cache_usage_perc": 0.25,
        ENGINE_CORES: 2.0,  # engine="0" and engine="1": a server with two DP ranks
    }


def test_parse_load_metrics_of_one_engine_core_reads_only_its_samples() -> None:
    # A data-parallel server labels each rank's samples engine="<rank>": a rank's backend
    # reads its own load, not the server's.
    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
"""
    one = {ENGINE_CORES: 1.0}
    assert parse_load_metrics(text, "1") == {"vllm:num_requests_running": 2.0, "vllm:num_requests_waiting": 1.0, **one}
    assert parse_load_metrics(text, "0") == {"vllm:num_requests_running": 3.0, "vllm:num_requests_waiting": 7.0, **one}
