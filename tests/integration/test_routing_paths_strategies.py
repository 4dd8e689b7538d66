"""Routing paths through the router for the strategies other than the probe race (round
robin, least loaded, prefix tree, direct, kv_events), against simulated engines. Routes are
read from the router's own metrics and logs, what the engines did from their own state.
"""

import asyncio
import logging

import pytest

from router.routing.kv_index import KvHit
from support.cluster import MODEL, MakeCluster, long_prompt
from support.kv_publisher import KvPublisher, stored
from support.polling import eventually


@pytest.mark.parametrize("strategy", ["round_robin", "least_loaded", "prefix_tree"])
async def test_other_strategies_route_directly(
    make_cluster: MakeCluster, strategy: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cachehit_router.requests")
    c = await make_cluster(decoders=2, prefillers=1, routing={"strategy": strategy})
    for i in range(4):  # forwarded whole, then streamed, in turn
        send = c.stream if i % 2 else c.complete
        status, _ = await send({"model": MODEL, "prompt": long_prompt(f"s{i}", 100), "max_tokens": 2})
        assert status == 200
    assert c.routes() == {"probe_hit": 0, "pd": 0, "direct": 4}
    # Each log line says why: the strategy's own choice and, where it ranks the engines by
    # the cost model, the next best with its prediction (round robin ranks nothing).
    lines = [r.__dict__["request"] for r in caplog.records if r.name == "cachehit_router.requests"]
    assert [rec["route_reason"] for rec in lines] == ["direct"] * 4
    for rec in lines:
        other = {"d0": "d1", "d1": "d0"}[rec["winner"]]
        if strategy == "round_robin":
            assert "route_alternative" not in rec, rec
        else:
            assert rec["route_alternative"].split()[:2] in (["next", other], ["tied", other]), rec
    served = await c.engine_metrics("vllm:request_success_total")
    assert served["p0"] == 0
    assert served["d0"] + served["d1"] == 4
    if strategy == "round_robin":
        assert served["d0"] == served["d1"] == 2


async def test_direct_strategy_forwards_non_streaming_and_retries_a_dead_backend(make_cluster: MakeCluster) -> None:
    c = await make_cluster(
        decoders=2,
        prefillers=0,
        routing={"strategy": "round_robin"},
        health={"scrape_interval_s": 30, "check_interval_s": 60},
    )
    await c.engines["d0"].close()  # dead, and the (slow) health checks have not noticed
    for i in range(4):
        status, out = await c.complete({"model": MODEL, "prompt": long_prompt(f"rr{i}", 30), "max_tokens": 3})
        assert status == 200, out
        assert out["object"] == "text_completion"
        assert out["usage"]["completion_tokens"] == 3
        assert out["id"].startswith("cmpl-")
    assert c.router_metric("cachehit_router_upstream_errors_total", backend="d0", kind="connect") >= 1
    assert c.routes()["direct"] == 4
    assert await c.engine_metric("d1", "vllm:request_success_total") == 4


async def test_direct_strategy_forwards_return_token_ids_to_the_engine(make_cluster: MakeCluster) -> None:
    # Admission takes return_token_ids out of the body (streamed legs always ask for ids);
    # a forwarded non-streaming answer is the engine's own, so its leg must ask for them.
    c = await make_cluster(decoders=1, prefillers=0, routing={"strategy": "round_robin"})
    prompt = [11, 12, 13, 14, 15]
    status, out = await c.complete({"model": MODEL, "prompt": prompt, "max_tokens": 2, "return_token_ids": True})
    assert status == 200, out
    assert c.routes()["direct"] == 1
    assert out["choices"][0]["prompt_token_ids"] == prompt
    assert len(out["choices"][0]["token_ids"]) == 2
    status, out = await c.complete({"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert status == 200, out
    assert out["choices"][0].get("prompt_token_ids") is None


@pytest.mark.parametrize("stream", [False, True])
async def test_kv_events_routes_by_the_index_whether_the_client_streams_or_not(
    make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    # d1's stream says it holds the prompt's 6 blocks (of 4 tokens; published before the
    # router subscribes: its replay brings them); d0 has no stream. A non-streaming client
    # is forwarded whole (Dispatcher.serve_unary): it is planned on the index all the same.
    caplog.set_level(logging.INFO, logger="cachehit_router")
    prompt = list(range(500, 526))
    hashes = [f"b{i}".encode() for i in range(6)]
    pub = KvPublisher()
    try:
        pub.publish(stored(hashes, prompt[:24]))
        c = await make_cluster(
            decoders=2,
            routing={"strategy": "kv_events"},
            per_backend={"d1": {"kv_events_endpoint": pub.endpoint, "kv_events_replay_endpoint": pub.replay_endpoint}},
        )
        assert c.state.kv_events is not None  # a backend has a KV-event endpoint
        index = c.state.kv_events.index
        await eventually(
            lambda: index.match(prompt).get("d1", KvHit(0, 0)).gpu_tokens == 24, what="d1's blocks indexed"
        )
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        for _ in range(2):
            caplog.clear()
            status, out = await (c.stream(body) if stream else c.complete(body))
            assert status == 200, out
            (rec,) = [r.__dict__["request"] for r in caplog.records if r.name == "cachehit_router.requests"]
            assert rec["indexed_hits"] == {"d1": 24}, rec
            assert rec["race_reason"] == "not_racing", rec
            assert rec["winner"] == "d1", rec
    finally:
        pub.close()


async def test_least_loaded_spreads_requests_that_arrive_together(make_cluster: MakeCluster) -> None:
    # Sent at once, they may be planned in one loop iteration: each leg's place in its
    # engine's load is taken before the request yields, so the next plan sees it.
    c = await make_cluster(decoders=2, prefillers=0, routing={"strategy": "least_loaded"})
    bodies = [{"model": MODEL, "prompt": long_prompt(f"together{i}", 400), "max_tokens": 2} for i in range(4)]
    results = await asyncio.gather(*(c.stream(b) for b in bodies))
    assert [status for status, _ in results] == [200] * 4
    served = await c.engine_metrics("vllm:request_success_total")
    assert served == {"d0": 2, "d1": 2}
    assert await c.wait_idle() == {"d0": 0, "d1": 0}
