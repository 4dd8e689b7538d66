"""The CPU tier of the KV cache (vLLM's OffloadingConnector): write-through of prompt blocks,
LRU, hits after the GPU cache evicted a prefix, counted in the threshold, `cached_tokens` and
vLLM's metric names."""

from __future__ import annotations

import aiohttp
import pytest

from engine_launcher.sim import SimEngineConfig
from engine_launcher.sim.cli import build_parser, config_from_args
from engine_launcher.sim.cpu_tier import CpuTier
from engine_launcher.sim.kv_cache import hash_blocks
from router.config.schema import BackendConfig, HealthConfig
from router.engine.scrape import parse_load_metrics
from router.fleet.registry import BackendRegistry
from support.metrics import scrape_metrics
from support.sim_http import MakeEngine, post
from support.sse import parse_sse

BS = 16
PROMPT_A = list(range(400, 464))  # 64 tokens = 4 blocks
PROMPT_B = list(range(1000, 1112))  # 112 tokens = 7 blocks
PROMPT_C = list(range(2000, 2112))  # 7 more blocks
# 9 blocks: block 0 is the null block, 8 usable (128 tokens). Running B and C after A
# evicts every block of A (freed tail first, A's first block is the last to go).
SMALL_GPU = dict(num_gpu_blocks=9, max_model_len=128)


def hashes(tokens: list[int]) -> list[int]:
    out: list[int] = []
    hash_blocks(tokens, BS, out)
    return out


def test_cpu_tier_is_an_lru_of_blocks_and_lookup_is_read_only() -> None:
    tier = CpuTier(capacity_blocks=3)
    assert tier.store([1, 2, 3]) == 3
    assert tier.store([1, 2]) == 0  # already stored: not stored again
    assert tier.lookup([1, 2, 3, 4], 0, 4) == 3
    assert tier.lookup([1, 2, 3], 1, 3) == 2  # from an index (after a GPU hit)
    assert tier.lookup([1, 9, 3], 0, 3) == 1  # a run from the start only
    tier.load([1])  # 1 is now the most recently used
    tier.store([4])  # full: evicts the LRU block, 2
    assert 2 not in tier
    assert 1 in tier
    assert 4 in tier
    assert tier.evicted_blocks == 1
    # Lookups touch nothing: 3 is still the next to go.
    tier.lookup([3], 0, 1)
    tier.store([5])
    assert 3 not in tier


async def evict_a_from_gpu(http: aiohttp.ClientSession, url: str) -> None:
    for prompt in (PROMPT_A, PROMPT_B, PROMPT_C):
        status, body = await post(http, url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert status == 200
        assert body["choices"][0]["finish_reason"] == "length"


async def test_an_offloaded_prefix_is_a_hit_that_a_gpu_only_engine_lacks(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    gpu_only = await make_engine(**SMALL_GPU)
    tiered = await make_engine(**SMALL_GPU, cpu_offload_tokens=1024)
    for eng in (gpu_only, tiered):
        await evict_a_from_gpu(http, eng.url)
        # A's blocks are gone from the GPU cache of both.
        assert eng.engine.kv.find_cache_hit(hashes(PROMPT_A), len(PROMPT_A)) == []
    body = {"prompt": PROMPT_A, "max_tokens": 2, "cache_hit_threshold": 0.75}
    _, rejected = await post(http, gpu_only.url + "/v1/completions", body)
    assert rejected["choices"][0]["finish_reason"] == "cache_threshold"
    assert rejected["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # All 4 blocks are loadable from host memory: the connector's lookup, unlike the GPU
    # cache's, may cover the last token (recomputed after the load).
    _, accepted = await post(http, tiered.url + "/v1/completions", body)
    assert accepted["choices"][0]["finish_reason"] == "length"
    assert accepted["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    url = tiered.url
    assert (await scrape_metrics(http, url)).value("vllm:prompt_tokens_cached_by_source_total", source="host") == 64
    assert (await scrape_metrics(http, url)).value("vllm:external_prefix_cache_hits_total") == 64
    assert (await scrape_metrics(http, url)).value("vllm:kv_offload_load_bytes_total") == 64 * 131072
    assert (await scrape_metrics(http, url)).value("vllm:kv_offload_load_time_total") > 0
    # Stored: the 4 + 7 + 7 prompt blocks, once each (A's reload stored nothing new).
    assert (await scrape_metrics(http, url)).value("vllm:kv_offload_store_bytes_total") == 18 * BS * 131072
    # The loaded blocks are in the GPU cache again: a third request hits 3 of them there
    # (the GPU lookup stops before the last token's block) and the 4th in host memory.
    _, again = await post(http, url + "/v1/completions", {"prompt": PROMPT_A, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert (await scrape_metrics(http, url)).value("vllm:prompt_tokens_cached_by_source_total", source="device") == 48
    assert (await scrape_metrics(http, url)).value("vllm:prompt_tokens_cached_by_source_total", source="host") == 80
    assert not (await scrape_metrics(http, gpu_only.url)).has("vllm:kv_offload_load_bytes_total")  # no CPU tier


@pytest.mark.parametrize("arrival_check", [True, False])
async def test_a_rejection_counts_the_cpu_tier_in_cached_tokens(
    make_engine: MakeEngine, http: aiohttp.ClientSession, arrival_check: bool
) -> None:
    eng = await make_engine(**SMALL_GPU, cpu_offload_tokens=1024, arrival_check=arrival_check)
    await evict_a_from_gpu(http, eng.url)
    # A's 64 tokens (in host memory only) of 96: 0.67.
    async with http.post(
        eng.url + "/v1/completions",
        json={
            "prompt": PROMPT_A + list(range(3000, 3032)),
            "max_tokens": 4,
            "cache_hit_threshold": 0.8,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        events = parse_sse(await r.read())
    assert events[0]["choices"][0]["finish_reason"] == "cache_threshold"
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    stage = "arrival" if arrival_check else "admission"
    assert (await scrape_metrics(http, eng.url)).value("cachehit_threshold_rejections_total", stage=stage) == 1
    # A rejection loads nothing.
    assert eng.engine.cpu.loaded_blocks == 0


async def test_only_prompt_blocks_are_offloaded(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(cpu_offload_tokens=1024)
    _, body = await post(http, eng.url + "/v1/completions", {"prompt": PROMPT_A, "max_tokens": 40, "ignore_eos": True})
    assert body["usage"]["completion_tokens"] == 40
    # 64 prompt tokens = 4 blocks; the 40 generated tokens fill 2 more GPU blocks, not stored.
    assert len(eng.engine.cpu) == 4
    assert len(eng.engine.kv.cached) == 6


async def test_the_cpu_tier_evicts_its_least_recently_used_blocks(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    # Room for 8 blocks: A (4), B (7), C (7) do not fit; A's blocks went first.
    eng = await make_engine(**SMALL_GPU, cpu_offload_tokens=8 * BS)
    await evict_a_from_gpu(http, eng.url)
    assert len(eng.engine.cpu) == 8
    _, body = await post(http, eng.url + "/v1/completions", {"prompt": PROMPT_A, "max_tokens": 1})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_the_router_learns_what_a_cpu_tier_hit_costs_from_the_engines_counters(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    tiered = await make_engine(**SMALL_GPU, cpu_offload_tokens=1024)
    gpu_only = await make_engine(**SMALL_GPU)
    engines = {"tiered": tiered, "gpu": gpu_only}
    registry = BackendRegistry([BackendConfig(name=n, url=e.url) for n, e in engines.items()], HealthConfig())

    async def scrape() -> None:
        for name, eng in engines.items():
            async with http.get(eng.url + "/metrics") as r:
                registry.record_scrape(name, parse_load_metrics(await r.text()), None)

    for eng in engines.values():
        await evict_a_from_gpu(http, eng.url)
    await scrape()
    for eng in engines.values():
        for _ in range(2):  # tiered: 64 host hits, then 48 device + 16 host; gpu: 0, then 48
            _, body = await post(http, eng.url + "/v1/completions", {"prompt": PROMPT_A, "max_tokens": 1})
            assert body["choices"][0]["finish_reason"] == "length"
    await scrape()
    timing, speed = tiered.engine.config.timing, tiered.engine.config.speed
    load_s, recompute_s = timing.cpu_load_token_s / speed, timing.prefill_token_s / speed
    held = registry.learner.speed("tiered").held_per_token_s
    # Load seconds per host-hit token, over the share of hits from host memory (80 of 128).
    assert held == pytest.approx(load_s * 80 / 128, rel=1e-6)
    assert 0 < held < recompute_s
    assert registry.learner.speed("gpu").held_per_token_s == 0.0


def test_cli_flags_reach_the_config() -> None:
    cfg = config_from_args(
        build_parser().parse_args(["--port", "0", "--cpu-offload-tokens", "4096", "--cpu-load-token-s", "0.0000003"])
    )
    assert cfg.cpu_offload_tokens == 4096
    assert cfg.timing.cpu_load_token_s == 0.0000003
    with pytest.raises(ValueError, match="cpu_offload_tokens"):
        SimEngineConfig(cpu_offload_tokens=-1).validate()
