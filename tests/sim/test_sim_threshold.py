"""The cache-hit threshold (vLLM RFC 24256) and the arrival-time check."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from engine_launcher.sim import SimEngineHandle
from support.metrics import scrape_metrics
from support.polling import eventually
from support.sim_http import MakeEngine, post
from support.sse import parse_sse

PROMPT = list(range(400, 464))  # 64 token ids = 4 blocks of 16


async def warm(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    status, _ = await post(http, url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 200


async def test_cold_request_below_threshold_is_rejected_without_tokens(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine()
    status, body = await post(
        http,
        eng.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 8, "cache_hit_threshold": 0.5, "return_token_ids": True},
    )
    assert status == 200
    ch = body["choices"][0]
    assert ch["finish_reason"] == "cache_threshold"
    assert ch["text"] == ""
    assert ch["token_ids"] == []
    assert body["usage"]["completion_tokens"] == 0
    assert (await scrape_metrics(http, eng.url)).value(
        "vllm:request_success_total", finished_reason="cache_threshold"
    ) == 1
    assert eng.engine.kv.usage == 0.0


async def test_warm_request_is_accepted_and_hit_rate_counts_whole_blocks(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine()
    url = eng.url
    await warm(http, url, PROMPT)
    # (64 - 1) // 16 = 3 blocks = 48 of 64 tokens: 0.75.
    _, body = await post(
        http, url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "cache_hit_threshold": 0.75}
    )
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    _status, body = await post(
        http, url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "cache_hit_threshold": 0.76}
    )
    assert body["choices"][0]["finish_reason"] == "cache_threshold"


@pytest.mark.parametrize("arrival_check", [True, False])
async def test_a_rejection_reports_the_partial_hit_as_cached_tokens(
    make_engine: MakeEngine, http: aiohttp.ClientSession, arrival_check: bool
) -> None:
    # What a router needs to send the fallback to the engine holding the most of the prompt.
    eng = await make_engine(arrival_check=arrival_check)
    await warm(http, eng.url, PROMPT)  # its 4 blocks are cached
    longer = PROMPT + list(range(900, 964))  # 128 tokens, 64 of them cached: 0.5
    status, body = await post(
        http, eng.url + "/v1/completions", {"prompt": longer, "max_tokens": 4, "cache_hit_threshold": 0.6}
    )
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "cache_threshold"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    async with http.post(
        eng.url + "/v1/completions",
        json={
            "prompt": longer,
            "max_tokens": 4,
            "cache_hit_threshold": 0.6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        events = parse_sse(await r.read())
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


async def test_top_level_wins_over_vllm_xargs(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    url = eng.url + "/v1/completions"
    _, body = await post(
        http,
        url,
        {"prompt": PROMPT, "max_tokens": 2, "cache_hit_threshold": 0, "vllm_xargs": {"cache_hit_threshold": 1.0}},
    )
    assert body["choices"][0]["finish_reason"] == "length"
    _, body = await post(http, url, {"prompt": PROMPT, "max_tokens": 2, "vllm_xargs": {"cache_hit_threshold": 1.0}})
    assert body["choices"][0]["finish_reason"] == "cache_threshold"


async def test_global_threshold_applies_when_the_request_has_none(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(global_cache_hit_threshold=0.5)
    url = eng.url + "/v1/completions"
    _, body = await post(http, url, {"prompt": PROMPT, "max_tokens": 2})
    assert body["choices"][0]["finish_reason"] == "cache_threshold"
    _, body = await post(http, url, {"prompt": PROMPT, "max_tokens": 2, "cache_hit_threshold": 0})
    assert body["choices"][0]["finish_reason"] == "length"


async def test_prefill_legs_are_never_rejected(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(role="producer", global_cache_hit_threshold=1.0)
    _, body = await post(
        http,
        eng.url + "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 1,
            "cache_hit_threshold": 1.0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        },
    )
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["kv_transfer_params"]["do_remote_prefill"] is True


async def test_completion_stream_rejection_framing(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    _, events = await post(
        http,
        eng.url + "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 8,
            "stream": True,
            "cache_hit_threshold": 0.9,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    )
    finish, usage, done = events
    assert done == "[DONE]"
    ch = finish["choices"][0]
    assert ch["finish_reason"] == "cache_threshold"
    assert ch["text"] == ""
    assert ch["token_ids"] == []
    assert ch["prompt_token_ids"] == PROMPT
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 0


async def test_chat_stream_rejection_framing(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    _, events = await post(
        http,
        eng.url + "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a cold prompt"}],
            "max_tokens": 8,
            "stream": True,
            "cache_hit_threshold": 0.9,
            "stream_options": {"include_usage": True},
        },
    )
    role, finish, usage, done = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert finish["choices"][0]["finish_reason"] == "cache_threshold"
    assert finish["choices"][0]["delta"] == {"content": ""}
    assert usage["usage"]["completion_tokens"] == 0
    assert done == "[DONE]"


async def _run_with_full_running_set(
    make_engine: MakeEngine, http: aiohttp.ClientSession, arrival_check: bool
) -> tuple[Any, int, int, SimEngineHandle]:
    """One long generation fills the running set (max_num_seqs=1); then a cold request
    with a threshold arrives. Returns (rejection body, long request's tokens at that time,
    the long request's max_tokens, engine)."""
    # Slow enough (3 ms steps) that the long request is still running when the cold one
    # arrives, however slow the test client is.
    eng = await make_engine(max_num_seqs=1, arrival_check=arrival_check, speed=2.0)
    long_tokens = 150
    long_task = asyncio.create_task(
        post(http, eng.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": long_tokens, "ignore_eos": True})
    )
    await eventually(lambda: eng.engine.num_running == 1)
    (long_req,) = eng.engine.running
    _, body = await post(
        http,
        eng.url + "/v1/completions",
        {"prompt": list(range(300, 364)), "max_tokens": 4, "cache_hit_threshold": 0.5},
    )
    generated_then = len(long_req.output_ids)
    status, long_body = await long_task
    assert status == 200
    assert long_body["usage"]["completion_tokens"] == long_tokens
    return body, generated_then, long_tokens, eng


async def test_arrival_check_rejects_at_once_under_a_full_running_set(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    body, generated_then, long_tokens, eng = await _run_with_full_running_set(make_engine, http, True)
    assert body["choices"][0]["finish_reason"] == "cache_threshold"
    # Rejected while the running request was still generating: it did not queue.
    assert generated_then < long_tokens
    assert eng.engine.stats.arrival_rejections == 1
    assert eng.engine.stats.admission_rejections == 0
    assert (await scrape_metrics(http, eng.url)).value("cachehit_threshold_rejections_total", stage="arrival") == 1


async def test_without_arrival_check_the_rejection_waits_in_the_queue(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    body, generated_then, long_tokens, eng = await _run_with_full_running_set(make_engine, http, False)
    assert body["choices"][0]["finish_reason"] == "cache_threshold"
    # The scheduler only looked at it once the running request had finished.
    assert generated_then == long_tokens
    assert eng.engine.stats.arrival_rejections == 0
    assert eng.engine.stats.admission_rejections == 1


async def test_admission_is_the_final_word_after_the_arrival_check(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    """Warm at arrival, evicted while queued: admission rejects it."""
    # Real-time steps: the warm prompt is still cached when it arrives (the long request
    # evicts the second of its blocks only after ~80 tokens, ~0.5 s).
    eng = await make_engine(max_num_seqs=1, block_size=16, num_gpu_blocks=1 + 8, max_model_len=128, speed=1.0)
    url = eng.url + "/v1/completions"
    await warm(http, eng.url, PROMPT)  # 4 cached blocks
    # A long request whose blocks evict the warm prompt while it runs (8 blocks total).
    long_task = asyncio.create_task(
        post(http, url, {"prompt": list(range(600, 616)), "max_tokens": 100, "ignore_eos": True})
    )
    await eventually(lambda: eng.engine.num_running == 1)
    _, body = await post(http, url, {"prompt": PROMPT, "max_tokens": 4, "cache_hit_threshold": 0.5})
    await long_task
    assert eng.engine.stats.arrival_rejections == 0
    assert eng.engine.stats.admission_rejections == 1
    assert body["choices"][0]["finish_reason"] == "cache_threshold"
    assert (await scrape_metrics(http, eng.url)).value("cachehit_threshold_rejections_total", stage="admission") == 1


async def test_invalid_thresholds_are_worded_as_the_plugin_does(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine()
    url = eng.url + "/v1/completions"
    _, err = await post(http, url, {"prompt": "x", "cache_hit_threshold": 1.5})
    assert err["error"] == {
        "message": "cache_hit_threshold must be between 0 and 1, got 1.5 (parameter=cache_hit_threshold, value=1.5)",
        "type": "BadRequestError",
        "param": "cache_hit_threshold",
        "code": 400,
    }
    _, err = await post(http, url, {"prompt": "x", "vllm_xargs": {"cache_hit_threshold": "0.5"}})
    assert err["error"]["message"].startswith(
        "vllm_xargs.cache_hit_threshold must be a number between 0 and 1, got str '0.5'"
    )
    assert err["error"]["param"] == "vllm_xargs.cache_hit_threshold"
