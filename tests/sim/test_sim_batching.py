"""Continuous batching, chunked prefill, max_num_seqs and the timing model (step counts
and model time, never wall-clock time)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from engine_launcher.sim import TimingModel
from support.polling import eventually
from support.sim_http import MakeEngine, post


def test_step_time_formula() -> None:
    t = TimingModel(step_overhead_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002)
    assert t.step_seconds(100, 0) == pytest.approx(0.11)
    assert t.step_seconds(0, 5) == pytest.approx(0.02)
    assert t.step_seconds(10, 3) == pytest.approx(0.026)


async def test_model_time_of_one_request_follows_the_timing_model(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    t = TimingModel(step_overhead_s=0.005, prefill_token_s=0.0001, decode_seq_s=0.0002)
    for speed in (100.0, 1000.0):
        eng = await make_engine(timing=t, speed=speed)
        await post(http, eng.url + "/v1/completions", {"prompt": list(range(2, 202)), "max_tokens": 10})
        # 1 prefill step of 200 tokens, then 9 decode steps of one sequence.
        expected = t.step_seconds(200, 0) + 9 * t.step_seconds(0, 1)
        assert eng.engine.stats.step_count == 10
        assert eng.engine.stats.busy_model_seconds * speed == pytest.approx(expected)


async def test_long_prompt_is_prefilled_in_chunks(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(max_num_batched_tokens=64)
    _, body = await post(http, eng.url + "/v1/completions", {"prompt": list(range(2, 302)), "max_tokens": 1})
    assert body["usage"]["completion_tokens"] == 1
    assert eng.engine.stats.step_count == 5  # ceil(300 / 64) steps before the first token


async def test_concurrent_requests_decode_in_the_same_steps(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(speed=1.0)  # 6 ms steps: all eight arrive within a step or two
    n, tokens = 8, 40
    results = await asyncio.gather(
        *(post(http, eng.url + "/v1/completions", {"prompt": [i + 2] * 20, "max_tokens": tokens}) for i in range(n))
    )
    assert all(b["usage"]["completion_tokens"] == tokens for _, b in results)
    # Sequential service would need n * tokens steps; batching needs about `tokens`.
    assert eng.engine.stats.step_count < 2 * tokens


async def test_max_num_seqs_bounds_the_running_set(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(max_num_seqs=3, speed=100.0)
    seen: list[int] = []
    tasks = [
        asyncio.create_task(
            post(http, eng.url + "/v1/completions", {"prompt": [i + 2] * 8, "max_tokens": 60, "ignore_eos": True})
        )
        for i in range(7)
    ]

    async def watch() -> None:
        while not all(t.done() for t in tasks):
            seen.append(eng.engine.num_running)
            await asyncio.sleep(0)  # sample the running set at every scheduling point

    await asyncio.gather(watch(), *tasks)
    assert max(seen) == 3
    assert all(t.result()[1]["usage"]["completion_tokens"] == 60 for t in tasks)


async def test_token_budget_limits_prefill_per_step(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(max_num_batched_tokens=100, speed=10.0)
    # Two 80-token prompts cannot both be prefilled in one 100-token step.
    await asyncio.gather(
        *(post(http, eng.url + "/v1/completions", {"prompt": [i + 2] * 80, "max_tokens": 1}) for i in range(2))
    )
    assert eng.engine.stats.step_count >= 2


async def test_engine_keeps_many_streams_with_one_loop_task(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(speed=1.0)  # real time, so the streams overlap
    before = len(asyncio.all_tasks())
    tasks = [
        asyncio.create_task(
            post(http, eng.url + "/v1/completions", {"prompt": [i % 500 + 2] * 10, "max_tokens": 30, "stream": True})
        )
        for i in range(200)
    ]
    await eventually(lambda: eng.engine.num_running > 50)
    # Per request: the client task and the server handler task; no per-token tasks.
    assert len(asyncio.all_tasks()) <= before + 2 * 200 + 5
    results = await asyncio.gather(*tasks)
    assert all(r[1][-1] == "[DONE]" for r in results)


async def test_a_cache_smaller_than_max_model_len_caps_requests(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    # 9 usable blocks of 16 = 144 tokens: a request never outgrows the cache alone.
    eng = await make_engine(max_model_len=1024, block_size=16, num_gpu_blocks=10)
    status, body = await post(
        http, eng.url + "/v1/completions", {"prompt": [5] * 100, "max_tokens": 500, "ignore_eos": True}
    )
    assert status == 200
    assert body["usage"]["completion_tokens"] == 44
    status, err = await post(http, eng.url + "/v1/completions", {"prompt": [5] * 150})
    assert status == 400
    assert err["error"]["param"] == "input_tokens"
    assert "maximum context length is 144 tokens" in err["error"]["message"]
