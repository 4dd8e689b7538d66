"""Preemption (RECOMPUTE) when the KV cache runs out, and the threshold check on
re-admission that hands back a preempted request with its partial output."""

from __future__ import annotations

import asyncio

import aiohttp

from engine_launcher.sim import tokenizer as tok
from support.metrics import scrape_metrics
from support.polling import eventually
from support.sim_http import MakeEngine, post


async def test_tiny_cache_forces_preemption_and_everything_still_completes(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(block_size=4, num_gpu_blocks=1 + 16, max_model_len=64, speed=100.0)
    results = await asyncio.gather(
        *(
            post(
                http,
                eng.url + "/v1/completions",
                {"prompt": [i + 2] * 8, "max_tokens": 40, "ignore_eos": True, "return_token_ids": True},
            )
            for i in range(4)
        )
    )
    assert (await scrape_metrics(http, eng.url)).value("vllm:num_preemptions_total") > 0
    for status, body in results:
        assert status == 200
        ch = body["choices"][0]
        assert ch["finish_reason"] == "length"
        assert len(ch["token_ids"]) == 40
        assert ch["text"] == tok.decode(ch["token_ids"])
    assert eng.engine.kv.usage == 0.0


async def test_preempted_request_rejected_on_readmission_keeps_its_tokens(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    # Real-time steps (6 ms): the third request arrives a few steps after the first two,
    # long before they fill the cache, however slow the test client is.
    eng = await make_engine(block_size=4, num_gpu_blocks=1 + 12, max_model_len=64, speed=1.0)
    url = eng.url + "/v1/completions"
    a_prompt = list(range(100, 116))  # 4 blocks
    await post(http, url, {"prompt": a_prompt, "max_tokens": 1})  # warm: 0.75 hit later
    others = [
        asyncio.create_task(post(http, url, {"prompt": [i + 2] * 4, "max_tokens": 40, "ignore_eos": True}))
        for i in range(2)
    ]
    await eventually(lambda: eng.engine.num_running == 2)
    # Admitted last, so the first to be preempted; its cache is gone when it comes back.
    status, body = await post(
        http,
        url,
        {
            "prompt": a_prompt,
            "max_tokens": 40,
            "ignore_eos": True,
            "cache_hit_threshold": 0.5,
            "return_token_ids": True,
        },
    )
    await asyncio.gather(*others)
    assert status == 200
    ch = body["choices"][0]
    assert ch["finish_reason"] == "cache_threshold"
    assert 0 < len(ch["token_ids"]) < 40
    assert ch["text"] == tok.decode(ch["token_ids"])
    assert body["usage"]["completion_tokens"] == len(ch["token_ids"])
    # It was accepted at first with a 12-token hit.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 12
    assert (await scrape_metrics(http, eng.url)).value("vllm:num_preemptions_total") >= 1
    assert (await scrape_metrics(http, eng.url)).value("cachehit_threshold_rejections_total", stage="readmission") == 1


async def test_preempted_stream_ends_with_cache_threshold_after_its_tokens(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    # Real-time steps (6 ms): the third request arrives a few steps after the first two,
    # long before they fill the cache, however slow the test client is.
    eng = await make_engine(block_size=4, num_gpu_blocks=1 + 12, max_model_len=64, speed=1.0)
    url = eng.url + "/v1/completions"
    a_prompt = list(range(100, 116))
    await post(http, url, {"prompt": a_prompt, "max_tokens": 1})
    others = [
        asyncio.create_task(post(http, url, {"prompt": [i + 2] * 4, "max_tokens": 40, "ignore_eos": True}))
        for i in range(2)
    ]
    await eventually(lambda: eng.engine.num_running == 2)
    _, events = await post(
        http,
        url,
        {
            "prompt": a_prompt,
            "max_tokens": 40,
            "ignore_eos": True,
            "cache_hit_threshold": 0.5,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    )
    await asyncio.gather(*others)
    *chunks, usage, done = events
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "cache_threshold"
    assert 0 < len(ids) < 40
    assert usage["usage"]["completion_tokens"] == len(ids)
    assert done == "[DONE]"
