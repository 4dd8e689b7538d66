"""Metric values: prefix-cache counters, cache config info, gauges, per-engine registries."""

from __future__ import annotations

import aiohttp

from support.metrics import scrape_metrics
from support.sim_http import MakeEngine, post


async def test_prefix_cache_counters_count_tokens(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(block_size=16)
    prompt = list(range(100, 164))  # 64 tokens
    for _ in range(2):
        await post(http, eng.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert (await scrape_metrics(http, eng.url)).value("vllm:prefix_cache_queries_total") == 128
    assert (await scrape_metrics(http, eng.url)).value("vllm:prefix_cache_hits_total") == 48
    assert (await scrape_metrics(http, eng.url)).value("vllm:prompt_tokens_total") == 128
    assert (await scrape_metrics(http, eng.url)).value("vllm:generation_tokens_total") == 4
    assert (await scrape_metrics(http, eng.url)).value(
        "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
    ) == 48
    assert (await scrape_metrics(http, eng.url)).value(
        "vllm:prompt_tokens_by_source_total", source="local_compute"
    ) == 80
    assert (await scrape_metrics(http, eng.url)).value("vllm:request_success_total", finished_reason="length") == 2
    assert (await scrape_metrics(http, eng.url)).value("vllm:time_to_first_token_seconds_count") == 2
    assert (await scrape_metrics(http, eng.url)).value("vllm:e2e_request_latency_seconds_count") == 2
    assert (await scrape_metrics(http, eng.url)).value("vllm:request_queue_time_seconds_count") == 2


async def test_cache_config_info_and_labels(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(block_size=32, num_gpu_blocks=100, model="m")
    assert (await scrape_metrics(http, eng.url)).value(
        "vllm:cache_config_info", block_size="32", num_gpu_blocks="100", enable_prefix_caching="True", engine="0"
    ) == 1
    assert (await scrape_metrics(http, eng.url)).value("vllm:num_requests_running", model_name="m", engine="0") == 0


async def test_engines_in_one_process_have_separate_registries(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    a = await make_engine()
    b = await make_engine()
    await post(http, a.url + "/v1/completions", {"prompt": "the world", "max_tokens": 3})
    assert (await scrape_metrics(http, a.url)).value("vllm:generation_tokens_total") == 3
    assert (await scrape_metrics(http, b.url)).value("vllm:generation_tokens_total") == 0
