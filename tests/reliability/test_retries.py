"""Retries: a connection failure or a 5xx before the first token is
retried on another backend, at most routing.max_retries times; a 4xx is the client's and
is not retried; after the first token the resume path takes over (test_fault_injection,
test_timeouts, tests/integration/test_resume.py)."""

from __future__ import annotations

import pytest

from support.cluster import MODEL, FaultConfig, MakeCluster


@pytest.mark.parametrize("strategy", ["round_robin", "probe"])
@pytest.mark.parametrize("stream", [False, True])
async def test_500s_before_the_first_token_are_retried_elsewhere(
    make_cluster: MakeCluster, strategy: str, stream: bool
) -> None:
    # race "always": every probe-mode request asks d0, whatever the race has been worth.
    c = await make_cluster(
        decoders=2,
        routing={"strategy": strategy, "race": "always"},
        per_engine={"d0": {"faults": FaultConfig(error_rate=1.0)}},
        health={"failure_threshold": 100},
    )
    for i in range(6):
        body = {"model": MODEL, "prompt": f"retry me {i}", "max_tokens": 4}
        if stream:
            status, events = await c.stream({**body, "stream_options": {"include_usage": True}})
            assert status == 200, events
            assert events[-1] == "[DONE]", events
            assert events[-2]["usage"]["completion_tokens"] == 4
            assert not any("error" in e for e in events[:-1])
        else:
            status, out = await c.complete(body)
            assert status == 200, out
            assert out["usage"]["completion_tokens"] == 4
    # d0 was tried (and failed) and every answer came from d1.
    assert c.router_metric("cachehit_router_upstream_errors_total", backend="d0", kind="status") >= 3
    if strategy == "round_robin":  # the probe race absorbs a failed probe without a retry
        assert c.router_metric("cachehit_router_retries_total") >= 3
    assert await c.wait_idle(5) == {"d0": 0, "d1": 0}


@pytest.mark.parametrize("stream", [False, True])
async def test_retries_are_bounded_and_end_with_a_clear_502(make_cluster: MakeCluster, stream: bool) -> None:
    c = await make_cluster(
        decoders=3,
        routing={"strategy": "round_robin", "max_retries": 1},
        sim={"faults": FaultConfig(error_rate=1.0)},
        health={"failure_threshold": 100},
    )
    body = {"model": MODEL, "prompt": "everyone fails", "max_tokens": 4}
    if stream:
        status, events = await c.stream(body)
        out = events[0]
    else:
        status, out = await c.complete(body)
    assert status == 502, out
    assert "500" in out["error"]["message"]
    assert out["error"]["code"] == 502
    # max_retries = 1: two attempts, on two different engines, no third.
    assert c.router_metric("cachehit_router_upstream_errors_total", kind="status") == 2
    assert c.router_metric("cachehit_router_retries_total") == 1


@pytest.mark.parametrize("strategy", ["round_robin", "probe"])
async def test_a_dead_backend_the_router_still_thinks_healthy_is_retried(
    make_cluster: MakeCluster, strategy: str
) -> None:
    # Health checks far apart: the router learns of d0's death from the request itself.
    c = await make_cluster(
        decoders=2, routing={"strategy": strategy}, health={"scrape_interval_s": 60.0, "check_interval_s": 60.0}
    )
    await c.engines["d0"].close()
    # A stream kept decoding on the live engine (d1, retried there if first sent to d0) makes
    # d0 the less loaded engine for every strategy; without it, idle engines tie and the
    # tie-break (their scraped KV usage, read once) could send all four requests to d1.
    held = {"model": MODEL, "prompt": "held", "max_tokens": 2000, "stream": True}
    async with await c.post("/v1/completions", held) as busy:
        assert busy.status == 200
        await busy.content.readline()  # its first event: the leg is decoding
        for i in range(4):
            status, events = await c.stream(
                {"model": MODEL, "prompt": f"dead {i}", "max_tokens": 3, "stream_options": {"include_usage": True}}
            )
            assert status == 200, events
            assert events[-2]["usage"]["completion_tokens"] == 3, events
    assert c.router_metric("cachehit_router_upstream_errors_total", backend="d0", kind="connect") >= 1


async def test_client_errors_are_not_retried(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=3, routing={"strategy": "round_robin"})
    status, out = await c.complete({"model": MODEL, "prompt": "x", "max_tokens": 4, "logprobs": 50})
    assert status == 400
    assert out["error"]["param"] == "logprobs"
    assert c.router_metric_or_zero("cachehit_router_retries_total") == 0
    assert c.router_metric_or_zero("cachehit_router_upstream_errors_total") <= 1
    assert all(s.breaker == "closed" for s in c.registry.states.values())
