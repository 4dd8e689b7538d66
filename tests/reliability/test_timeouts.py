"""Timeouts: connect, first token, idle between chunks, total.

Each ends with a precise OpenAI-style error (504 naming what timed out; once the stream
started, an error event then [DONE]) and cancels the upstream request: the engine's
running count returns to 0. The waits here are liveness bounds, not speed checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import pytest

from engine_launcher.sim.request import SimRequest
from support.cluster import MODEL, FaultConfig, MakeCluster, long_prompt
from support.polling import eventually


def _assert_error(body: dict[str, Any], status: int, *needles: str) -> str:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status, err
    assert err["type"] == "GatewayTimeoutError", err
    for n in needles:
        assert n in err["message"], err["message"]
    message: str = err["message"]
    return message


def _stream_error(events: list[Any]) -> dict[str, Any]:
    """A stream that failed after it started: ..., error event, [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    assert "error" in events[-2], events[-3:]
    assert not any("error" in e for e in events[:-2] if isinstance(e, dict))
    error_event: dict[str, Any] = events[-2]
    return error_event


@pytest.mark.parametrize("stream", [False, True])
async def test_first_token_timeout_is_a_504_and_aborts_the_engine_request(
    make_cluster: MakeCluster, stream: bool
) -> None:
    # speed 0.002: the prefill step of this prompt takes seconds, so no token comes in time.
    c = await make_cluster(decoders=1, sim={"speed": 0.002}, timeouts={"first_token_s": 1.0})
    body = {"model": MODEL, "prompt": long_prompt("slow-first", 200), "max_tokens": 5}
    async with asyncio.timeout(15):
        if stream:
            status, events = await c.stream(body)
            out = events[0]
        else:
            status, out = await c.complete(body)
    assert status == 504, out
    _assert_error(out, 504, "1 s", "first token", "d0")
    assert await c.wait_idle(10) == {"d0": 0}


@pytest.mark.parametrize("stream", [False, True])
async def test_idle_timeout_mid_stream_ends_with_a_precise_error(make_cluster: MakeCluster, stream: bool) -> None:
    # One engine, stalling every stream after 3 tokens: the leg times out between chunks;
    # the resume finds no other engine, so the client learns exactly what happened.
    c = await make_cluster(
        decoders=1, timeouts={"idle_s": 1.0}, sim={"faults": FaultConfig(stall_after_tokens=3, stall_seconds=30.0)}
    )
    body = {"model": MODEL, "prompt": "stall please", "max_tokens": 20}
    async with asyncio.timeout(15):
        if stream:
            status, events = await c.stream(body)
            assert status == 200
            err = _stream_error(events)
            _assert_error(err, 504, "1 s", "next chunk", "d0")
            assert any(e["choices"] and e["choices"][0].get("text") for e in events[:-2])
        else:
            status, out = await c.complete(body)
            assert status == 504, out
            _assert_error(out, 504, "next chunk", "d0")
    assert await c.wait_idle(10) == {"d0": 0}


async def test_idle_timeout_resumes_on_a_healthy_engine(make_cluster: MakeCluster) -> None:
    """With another engine available the same stall is invisible to the client."""
    c = await make_cluster(
        decoders=2,
        timeouts={"idle_s": 1.0},
        per_engine={"d0": {"faults": FaultConfig(stall_after_tokens=3, stall_seconds=30.0)}},
    )
    prompt = long_prompt("stall-resume", 100)
    # Warm d0 so the probe race picks it.
    async with c.session.post(
        c.engines["d0"].url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
    ) as r:
        assert r.status == 200
    async with asyncio.timeout(20):
        status, events = await c.stream(
            {"model": MODEL, "prompt": prompt, "max_tokens": 12, "stream_options": {"include_usage": True}}
        )
    assert status == 200
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    assert events[-2]["usage"]["completion_tokens"] == 12
    assert c.router_metric("cachehit_router_resumes_total", reason="failure") == 1
    assert c.router_metric("cachehit_router_upstream_errors_total", backend="d0", kind="idle_timeout") == 1
    assert await c.wait_idle(10) == {"d0": 0, "d1": 0}


@pytest.mark.parametrize("stream", [False, True])
async def test_total_timeout_is_not_resumed_and_names_the_whole_answer(make_cluster: MakeCluster, stream: bool) -> None:
    # speed 0.05: ~0.2 s per decode step, so 200 tokens need far more than total_s = 2.
    c = await make_cluster(decoders=2, sim={"speed": 0.05}, timeouts={"total_s": 2.0})
    body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 200}
    async with asyncio.timeout(15):
        if stream:
            status, events = await c.stream(body)
            assert status == 200
            _assert_error(_stream_error(events), 504, "2 s", "whole answer")
        else:
            status, out = await c.complete(body)
            assert status == 504, out
            _assert_error(out, 504, "2 s", "whole answer")
    assert c.router_metric_or_zero("cachehit_router_resumes_total", reason="failure") == 0
    assert await c.wait_idle(10) == {"d0": 0, "d1": 0}


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:  # ENOTCONN while the handshake is pending
        return False
    return True


async def test_connect_timeout_is_a_504_naming_the_connection(make_cluster: MakeCluster) -> None:
    """The engine's port stops accepting (a full listen backlog drops SYNs, as a hung
    host does): the router gives up after timeouts.connect_s and says so."""
    c = await make_cluster(
        decoders=1, timeouts={"connect_s": 1.0}, health={"scrape_interval_s": 60.0, "check_interval_s": 60.0}
    )
    port = c.engines["d0"].port
    await c.engines["d0"].close()
    black = socket.socket()
    black.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    black.bind(("127.0.0.1", port))
    black.listen(0)
    fillers = []
    try:
        for _ in range(3):  # fill the accept queue; later SYNs are dropped
            f = socket.socket()
            f.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                f.connect(("127.0.0.1", port))
            fillers.append(f)
        # listen(0) queues one connection: once a filler's handshake completed, the backlog
        # is full and later SYNs are dropped.
        await eventually(lambda: any(_connected(f) for f in fillers), 5, "a filler connected: backlog full")
        async with asyncio.timeout(15):
            status, out = await c.complete({"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert status == 504, out
        _assert_error(out, 504, "1 s", "connect", "d0")
    finally:
        for f in fillers:
            f.close()
        black.close()


async def test_timeouts_count_against_the_backend(make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle timeouts are backend failures: after failure_threshold of them the breaker
    opens and the engine gets nothing (no probes either) during the cool-down, while the
    answers themselves complete on the other engine."""
    c = await make_cluster(
        decoders=2,
        timeouts={"idle_s": 0.5},
        routing={"race": "always"},
        per_engine={"d0": {"faults": FaultConfig(stall_after_tokens=2, stall_seconds=30.0)}},
        health={"failure_threshold": 2, "cooldown_s": 60.0},
    )
    prompts = [long_prompt(f"count{i}", 100) for i in range(3)]
    for p in prompts:  # warm d0 with each prompt: the probe race picks it
        async with c.session.post(
            c.engines["d0"].url + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 1}
        ) as r:
            assert r.status == 200
    for p in prompts[:2]:
        async with asyncio.timeout(10):
            status, events = await c.stream(
                {"model": MODEL, "prompt": p, "max_tokens": 6, "stream_options": {"include_usage": True}}
            )
        assert status == 200, events[-3:]
        assert events[-2]["usage"]["completion_tokens"] == 6, events[-3:]
    assert c.router_metric("cachehit_router_resumes_total", reason="failure") == 2
    assert c.registry.states["d0"].breaker == "open"
    assert c.router_metric("cachehit_router_backend_circuit_state", backend="d0") == 2
    assert c.router_metric("cachehit_router_backend_healthy", backend="d0") == 0
    seen: list[str] = []
    eng = c.engines["d0"].engine
    orig = eng.add_request

    def recording_add_request(req: SimRequest) -> None:
        seen.append(req.request_id)
        orig(req)

    monkeypatch.setattr(eng, "add_request", recording_add_request)
    for _ in range(3):
        status, out = await c.complete({"model": MODEL, "prompt": prompts[2], "max_tokens": 2})
        assert status == 200, out
    assert seen == []  # open: not even probed, although it holds the prompt's cache
    assert await c.wait_idle(10) == {"d0": 0, "d1": 0}


async def test_a_resume_may_go_back_to_an_engine_that_failed_an_earlier_leg(make_cluster: MakeCluster) -> None:
    """Both engines stall once per request after 4 tokens. The answer moves d -> other d ->
    back to the first (which is fine for a new request): only the engine that failed last
    is kept out of a resume, so two engines are enough for three legs."""
    stall = {"faults": FaultConfig(stall_after_tokens=4, stall_seconds=30.0)}
    c = await make_cluster(
        decoders=2, timeouts={"idle_s": 0.5}, routing={"max_resumes": 5}, per_engine={"d0": stall, "d1": stall}
    )
    async with asyncio.timeout(30):
        status, events = await c.stream(
            {
                "model": MODEL,
                "prompt": long_prompt("ping-pong", 50),
                "max_tokens": 12,
                "stream_options": {"include_usage": True},
            }
        )
    assert status == 200
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1]), events
    assert events[-2]["usage"]["completion_tokens"] == 12
    assert c.router_metric("cachehit_router_resumes_total", reason="failure") == 2
    assert (
        sum(
            c.router_metric_or_zero("cachehit_router_upstream_errors_total", backend=d, kind="idle_timeout")
            for d in ("d0", "d1")
        )
        == 2
    )
    assert await c.wait_idle(10) == {"d0": 0, "d1": 0}
