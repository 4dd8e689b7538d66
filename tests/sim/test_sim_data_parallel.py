"""`--data-parallel-size N` (engine_launcher/sim/data_parallel.py): N engine cores, N KV
caches behind one port, a rank chosen by vLLM's X-data-parallel-rank header, each rank's
metrics under its own `engine` label."""

from __future__ import annotations

import aiohttp
import orjson

from support.metrics import parse_metrics
from support.sim_http import MakeEngine

PROMPT = " ".join(["alpha beta gamma delta"] * 40)


async def _complete(http: aiohttp.ClientSession, url: str, rank: str | None) -> tuple[int, dict[str, object]]:
    headers = {} if rank is None else {"X-data-parallel-rank": rank}
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 1}
    async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
        return r.status, orjson.loads(await r.read())


def _cached(answer: dict[str, object]) -> int:
    usage = answer["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


async def test_each_rank_has_its_own_cache(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(model="sim-model", data_parallel_size=2)
    assert len(eng.server.engines) == 2
    status, first = await _complete(http, eng.url, "0")
    assert status == 200
    assert _cached(first) == 0
    # The same prompt on rank 1 finds nothing: rank 0 holds it.
    status, other = await _complete(http, eng.url, "1")
    assert status == 200
    assert _cached(other) == 0
    status, again = await _complete(http, eng.url, "0")
    assert status == 200
    assert _cached(again) > 0
    assert [e.stats.total_generated for e in eng.server.engines] == [2, 1]


async def test_a_rank_out_of_range_is_vllms_400(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(model="sim-model", data_parallel_size=2)
    for bad in ("2", "-1", "x"):
        status, body = await _complete(http, eng.url, bad)
        assert status == 400, bad
        assert "data_parallel_rank" in str(body["error"])


async def test_without_a_rank_the_least_loaded_rank_serves(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(model="sim-model", data_parallel_size=2)
    for _ in range(4):
        status, _answer = await _complete(http, eng.url, None)
        assert status == 200
    # Idle ranks take turns, as vLLM's DP balancer spreads equal load.
    assert [e.stats.total_generated for e in eng.server.engines] == [2, 2]


async def test_metrics_carry_each_rank_under_its_engine_label(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(model="sim-model", data_parallel_size=2)
    await _complete(http, eng.url, "1")
    async with http.get(eng.url + "/metrics") as r:
        m = parse_metrics(await r.text())
    assert m.value("vllm:request_success_total", engine="1") == 1
    assert m.value("vllm:request_success_total", engine="0") == 0
    # The cache config too, one sample per rank (vLLM writes it for each engine index).
    for rank in ("0", "1"):
        assert m.value("vllm:cache_config_info", engine=rank, num_gpu_blocks=str(eng.config.num_gpu_blocks)) == 1


async def test_adapters_are_the_servers_every_rank_serves_them(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(model="sim-model", data_parallel_size=2)
    async with http.post(
        eng.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/adapters/sql"}
    ) as r:
        assert r.status == 200
    for rank in ("0", "1"):
        body = {"model": "sql", "prompt": "hello", "max_tokens": 1}
        async with http.post(eng.url + "/v1/completions", json=body, headers={"X-data-parallel-rank": rank}) as r:
            assert r.status == 200
