"""NIXL-like prefill/decode: the producer's kv_transfer_params and lease, the consumer's
pull over the side channel, and every way a pull can fail."""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp

from engine_launcher.sim import SimEngineHandle
from router.engine.wire import PREFILL_REQUEST_PARAMS
from support.metrics import scrape_metrics
from support.polling import eventually
from support.sim_http import MakeEngine, post

PROMPT = list(range(200, 300))


async def prefill(http: aiohttp.ClientSession, producer: SimEngineHandle, prompt: list[int] = PROMPT) -> dict[str, Any]:
    status, body = await post(
        http,
        producer.url + "/v1/completions",
        {"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_REQUEST_PARAMS},
    )
    assert status == 200
    assert body["usage"]["completion_tokens"] == 1
    params: dict[str, Any] = body["kv_transfer_params"]
    return params


async def decode(
    http: aiohttp.ClientSession, consumer: SimEngineHandle, kv: dict[str, Any], max_tokens: int = 10, **extra: Any
) -> dict[str, Any]:
    status, body = await post(
        http,
        consumer.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": max_tokens, "kv_transfer_params": kv, **extra},
    )
    assert status == 200
    assert body["usage"]["completion_tokens"] == max_tokens
    answer: dict[str, Any] = body
    return answer


async def test_prefill_leg_returns_vllm_shaped_params_and_holds_a_lease(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    producer = await make_engine(role="producer", block_size=16)
    kv = await prefill(http, producer)
    assert kv["do_remote_prefill"] is True
    assert kv["do_remote_decode"] is False
    assert len(kv["remote_block_ids"]) == 1
    assert len(kv["remote_block_ids"][0]) == 7
    assert kv["remote_engine_id"] == producer.engine.engine_id
    uuid.UUID(kv["remote_engine_id"])
    assert kv["remote_host"] == "127.0.0.1"
    assert kv["remote_port"] == producer.port
    assert kv["remote_request_id"].startswith("cmpl-")
    assert (kv["tp_size"], kv["dcp_size"], kv["pp_size"]) == (1, 1, 1)
    assert kv["remote_num_tokens"] == 100
    assert kv["transfer_mode"] == "pull"
    assert producer.engine.snapshot()["leases"] == 1
    assert producer.engine.kv.usage > 0  # blocks held by the lease, not by a request
    assert producer.engine.num_running == 0


async def test_decode_leg_pulls_counts_external_hits_and_ends_the_lease(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    producer = await make_engine(role="producer")
    consumer = await make_engine(role="consumer")
    kv = await prefill(http, producer)
    body = await decode(http, consumer, kv, cache_hit_threshold=1.0)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 100
    assert body["kv_transfer_params"] is None
    assert (await scrape_metrics(http, consumer.url)).value("vllm:external_prefix_cache_hits_total") == 100
    assert (await scrape_metrics(http, consumer.url)).value("vllm:external_prefix_cache_queries_total") == 100
    assert (await scrape_metrics(http, consumer.url)).value("vllm:nixl_num_failed_transfers_total") == 0
    assert producer.engine.snapshot()["leases"] == 0
    assert producer.engine.kv.usage == 0.0
    # The consumer computed one prompt token (the last), not the whole prompt.
    assert consumer.engine.stats.step_count == 10


async def test_expired_lease_fails_the_decode_leg_as_vllm_does_by_default(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    producer = await make_engine(role="producer", kv_lease_duration=0.05)
    consumer = await make_engine(role="consumer")
    kv = await prefill(http, producer)
    await eventually(lambda: not producer.engine.leases)
    assert (await scrape_metrics(http, producer.url)).value("vllm:nixl_num_kv_expired_reqs_total") == 1
    assert producer.engine.kv.usage == 0.0
    # kv_load_failure_policy "fail": vLLM ends the request with FinishReason.ERROR, a 500.
    status, body = await post(
        http, consumer.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": kv}
    )
    assert status == 500
    assert body == {
        "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
    }
    assert (await scrape_metrics(http, consumer.url)).value("vllm:nixl_num_failed_transfers_total") == 1
    assert (await scrape_metrics(http, consumer.url)).value("vllm:request_success_total", finished_reason="error") == 1
    assert consumer.engine.num_running == 0
    assert consumer.engine.kv.usage == 0.0
    # Streamed, the 200 has begun: one error event, then [DONE].
    async with http.post(
        consumer.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 5, "stream": True, "kv_transfer_params": kv},
    ) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw == (
        b'data: {"error":{"message":"Internal server error","type":"InternalServerError",'
        b'"param":null,"code":500}}\n\ndata: [DONE]\n\n'
    )


async def test_expired_lease_with_the_recompute_policy_computes_the_prompt(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    producer = await make_engine(role="producer", kv_lease_duration=0.05)
    consumer = await make_engine(role="consumer", kv_load_failure_policy="recompute")
    kv = await prefill(http, producer)
    await eventually(lambda: not producer.engine.leases)
    body = await decode(http, consumer, kv)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await scrape_metrics(http, consumer.url)).value("vllm:nixl_num_failed_transfers_total") == 1


async def test_pull_from_a_producer_that_is_gone_falls_back(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    producer = await make_engine(role="producer")
    consumer = await make_engine(role="consumer", kv_load_failure_policy="recompute")
    kv = await prefill(http, producer)
    await producer.close()
    await decode(http, consumer, kv)
    assert (await scrape_metrics(http, consumer.url)).value("vllm:nixl_num_failed_transfers_total") == 1


async def test_pull_of_an_unknown_request_falls_back(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    producer = await make_engine(role="producer")
    consumer = await make_engine(role="consumer", kv_load_failure_policy="recompute")
    kv = await prefill(http, producer)
    await decode(http, consumer, {**kv, "remote_request_id": "cmpl-unknown"})
    assert (await scrape_metrics(http, consumer.url)).value("vllm:nixl_num_failed_transfers_total") == 1
    assert producer.engine.snapshot()["leases"] == 1  # the real lease is untouched
    # The lease can still be pulled once, and only once.
    await decode(http, consumer, kv)
    await decode(http, consumer, kv)
    assert (await scrape_metrics(http, consumer.url)).value("vllm:nixl_num_failed_transfers_total") == 2


async def test_side_channel_errors(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    producer = await make_engine(role="producer")
    async with http.post(producer.url + "/_sim/kv/pull", data=b"nope") as r:
        assert r.status == 400
    async with http.post(
        producer.url + "/_sim/kv/pull", json={"remote_engine_id": producer.engine.engine_id, "remote_request_id": "x"}
    ) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == 404


async def test_consumer_only_engine_serves_ordinary_requests(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    consumer = await make_engine(role="consumer")
    status, body = await post(http, consumer.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert status == 200
    assert body["usage"]["completion_tokens"] == 3
    # Not a producer: a prefill leg runs as a plain request and leases nothing.
    status, body = await post(
        http,
        consumer.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_REQUEST_PARAMS},
    )
    assert status == 200
    assert body["kv_transfer_params"] is None
    assert not consumer.engine.leases


async def test_both_role_does_prefill_and_decode_and_streams_the_decode(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    a = await make_engine(role="both")
    b = await make_engine(role="both")
    kv = await prefill(http, a)
    _status, events = await post(
        http,
        b.url + "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 5,
            "kv_transfer_params": kv,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 100
    assert events[-2]["usage"]["completion_tokens"] == 5
    assert not a.engine.leases
