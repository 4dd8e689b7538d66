"""Fault injection (errors, stalls, engine death), runtime fault changes and prefix-cache
reset."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp
import pytest

from engine_launcher.sim import FaultConfig, SimEngineConfig, start_sim_engine
from support.polling import eventually
from support.sim_http import MakeEngine, post
from support.sse import parse_sse


async def test_error_rate_one_fails_every_request_with_a_500(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(faults=FaultConfig(error_rate=1.0))
    for stream in (False, True):
        status, body = await post(http, eng.url + "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": stream})
        assert status == 500
        assert body == {
            "error": {
                "message": "Simulated engine failure (fault injection)",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
    assert eng.engine.stats.step_count == 0


async def test_partial_error_rate_fails_some(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(faults=FaultConfig(error_rate=0.5), seed=3)
    statuses = [(await post(http, eng.url + "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] for _ in range(40)]
    assert set(statuses) == {200, 500}


async def test_stream_stalls_after_n_tokens_while_the_engine_goes_on(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(faults=FaultConfig(stall_after_tokens=3, stall_seconds=1.0))
    async with http.post(
        eng.url + "/v1/completions",
        json={"prompt": [9] * 8, "max_tokens": 20, "stream": True, "return_token_ids": True},
    ) as r:
        received = 0
        while received < 3:
            chunk = parse_sse(await r.content.readuntil(b"\n\n"))[0]
            received += len(chunk["choices"][0]["token_ids"])
        # The engine finishes the whole generation while the stream is stalled.
        await eventually(lambda: eng.engine.stats.total_generated == 20)
        assert received < 20
        rest = parse_sse(await r.read())
    received += sum(len(c["choices"][0]["token_ids"]) for c in rest[:-1])
    assert received == 20
    assert rest[-1] == "[DONE]"


async def test_exit_fault_drops_connections_and_stops_serving(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(faults=FaultConfig(exit_after_tokens=10), speed=100.0)
    with pytest.raises(aiohttp.ClientError):
        async with http.post(
            eng.url + "/v1/completions", json={"prompt": [9] * 8, "max_tokens": 100, "stream": True}
        ) as r:
            await r.read()
    assert eng.engine.dead
    await eventually(lambda: eng.server._runner is None)
    with pytest.raises(aiohttp.ClientError):
        async with http.get(eng.url + "/health") as r:
            await r.read()


async def test_faults_admin_route_is_off_by_default(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    async with http.post(eng.url + "/_sim/faults", json={"error_rate": 1.0}) as r:
        assert r.status == 404
    assert eng.engine.config.faults.error_rate == 0.0


async def test_faults_change_at_runtime_with_admin(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(enable_admin=True)
    url = eng.url + "/_sim/faults"
    async with http.post(url, json={"error_rate": 1.0}) as r:
        assert r.status == 200
        assert (await r.json())["error_rate"] == 1.0
    assert (await post(http, eng.url + "/v1/completions", {"prompt": "x"}))[0] == 500
    async with http.post(url, json={"error_rate": 0}) as r:
        assert r.status == 200
    assert (await post(http, eng.url + "/v1/completions", {"prompt": "x"}))[0] == 200
    for bad in ({"error_rate": 2}, {"bogus": 1}, {"stall_seconds": "x"}, [1]):
        async with http.post(url, json=bad) as r:
            assert r.status == 400, bad
    async with http.get(url) as r:
        assert (await r.json())["error_rate"] == 0.0


async def test_reset_prefix_cache(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(speed=20.0)
    url = eng.url + "/v1/completions"
    prompt = list(range(100, 164))
    await post(http, url, {"prompt": prompt, "max_tokens": 1})
    async with http.post(eng.url + "/reset_prefix_cache") as r:
        assert (await r.json()) == {"success": True}
    _, body = await post(http, url, {"prompt": prompt, "max_tokens": 1})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Refused while a request holds blocks (as vLLM).
    task = asyncio.create_task(post(http, url, {"prompt": prompt, "max_tokens": 500, "ignore_eos": True}))
    await eventually(lambda: eng.engine.num_running == 1)
    async with http.post(eng.url + "/reset_prefix_cache") as r:
        assert (await r.json()) == {"success": False}
    await task


async def test_engines_built_from_one_config_do_not_share_faults(http: aiohttp.ClientSession) -> None:
    base = SimEngineConfig(speed=1000.0, max_model_len=2048, num_gpu_blocks=1024)
    a = await start_sim_engine(replace(base, role="producer"))
    b = await start_sim_engine(replace(base, role="consumer"))
    try:
        a.config.faults.error_rate = 1.0
        assert (await post(http, a.url + "/v1/completions", {"prompt": "x"}))[0] == 500
        assert (await post(http, b.url + "/v1/completions", {"prompt": "x"}))[0] == 200
    finally:
        await a.close()
        await b.close()


async def test_a_slowdown_set_at_runtime_makes_every_step_that_much_longer(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(enable_admin=True, speed=50.0)

    async def modelled_s(token: int) -> float:  # a prompt of its own: nothing cached
        before = eng.engine.stats.busy_model_seconds
        body = {"prompt": [token] * 64, "max_tokens": 8, "ignore_eos": True}
        status, _ = await post(http, eng.url + "/v1/completions", body)
        assert status == 200
        return eng.engine.stats.busy_model_seconds - before

    alone = await modelled_s(9)
    status, faults = await post(http, eng.url + "/_sim/faults", {"slowdown": 3.0})
    assert (status, faults["slowdown"]) == (200, 3.0)
    assert await modelled_s(7) == pytest.approx(3 * alone)
    status, _ = await post(http, eng.url + "/_sim/faults", {"slowdown": -1})
    assert status == 400
