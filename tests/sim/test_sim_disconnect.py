"""A client that goes away aborts its request, as in vLLM: blocks freed, running back to 0."""

from __future__ import annotations

import asyncio

import aiohttp

from engine_launcher.sim import SimEngineConfig, start_sim_engine
from support.metrics import scrape_metrics
from support.polling import eventually
from support.sim_http import MakeEngine


async def test_stream_disconnect_aborts_the_request(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(speed=20.0)
    resp = await http.post(
        eng.url + "/v1/completions",
        json={"prompt": list(range(2, 50)), "max_tokens": 1000, "ignore_eos": True, "stream": True},
    )
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")  # first chunk: the request is running
    assert eng.engine.num_running == 1
    assert eng.engine.kv.usage > 0
    resp.close()  # drop the connection mid-stream
    await eventually(lambda: eng.engine.num_running == 0)
    assert eng.engine.kv.usage == 0.0
    assert (await scrape_metrics(http, eng.url)).value("vllm:num_requests_running") == 0
    assert (await scrape_metrics(http, eng.url)).value("vllm:request_success_total", finished_reason="abort") == 1


async def test_non_streaming_disconnect_aborts_the_request(make_engine: MakeEngine) -> None:
    eng = await make_engine(speed=20.0)
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(
            s.post(
                eng.url + "/v1/completions", json={"prompt": list(range(2, 50)), "max_tokens": 1000, "ignore_eos": True}
            )
        )
        await eventually(lambda: eng.engine.num_running == 1)
        task.cancel()
    await eventually(lambda: eng.engine.num_running == 0)
    assert eng.engine.kv.usage == 0.0


async def test_disconnect_while_waiting_removes_it_from_the_queue(make_engine: MakeEngine) -> None:
    eng = await make_engine(max_num_seqs=1, speed=20.0)
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(
            s.post(eng.url + "/v1/completions", json={"prompt": [5] * 10, "max_tokens": 1000, "ignore_eos": True})
        )
        await eventually(lambda: eng.engine.num_running == 1)
        second = asyncio.create_task(s.post(eng.url + "/v1/completions", json={"prompt": [6] * 10, "max_tokens": 10}))
        await eventually(lambda: eng.engine.num_waiting == 1)
        second.cancel()
        await eventually(lambda: eng.engine.num_waiting == 0)
        first.cancel()
    await eventually(lambda: eng.engine.num_running == 0)


async def test_closing_an_engine_ends_open_streams(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await start_sim_engine(SimEngineConfig(speed=1.0, max_model_len=2048, num_gpu_blocks=1024))
    resp = await http.post(
        eng.url + "/v1/completions", json={"prompt": [7] * 10, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    )
    await resp.content.readuntil(b"\n\n")
    # Guard only: a close that waited for the 2000-token generation would take 12 s+.
    await asyncio.wait_for(eng.close(), timeout=10)
    rest = await resp.read()
    assert b'"finish_reason":"abort"' in rest
    assert rest.endswith(b"data: [DONE]\n\n")
    assert eng.engine.num_running == 0
    assert not eng.engine.requests
