"""`/v1/messages` (the Anthropic Messages API) through the router on simulated engines: it
races, falls back and resumes as the chat completion vLLM makes of it, and answers in
vLLM's Anthropic shape, whole and streamed; the `anthropic` SDK reads it."""

from __future__ import annotations

from typing import Any

import anthropic
import orjson
import pytest

from engine_launcher.sim import FaultConfig
from support.cluster import MODEL, PD_PREFERRED, Cluster, MakeCluster, long_prompt

MESSAGES = "/v1/messages"


def _body(tag: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "system": long_prompt(tag, 150),
        "messages": [{"role": "user", "content": "go on"}],
        **extra,
    }


async def _events(c: Cluster, body: dict[str, Any]) -> tuple[int, list[tuple[str, Any]]]:
    """(status, [(event name, data)]) of a streamed /v1/messages answer."""
    async with await c.post(MESSAGES, {**body, "stream": True}) as r:
        raw = await r.read()
        if r.status != 200:
            return r.status, [("", orjson.loads(raw))]
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], orjson.loads(lines["data"])))
    return 200, out


def _text_of(events: list[tuple[str, Any]]) -> str:
    return "".join(d["delta"]["text"] for name, d in events if name == "content_block_delta")


async def test_whole_and_streamed_answers_have_vllms_anthropic_shape(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2)
    status, out = await c.complete(_body("shape"), MESSAGES)
    assert status == 200, out
    assert out["type"] == "message"
    assert out["role"] == "assistant"
    assert out["id"].startswith("chatcmpl-")
    assert out["stop_reason"] == "max_tokens"
    assert out["usage"]["output_tokens"] == 12
    (block,) = out["content"]
    assert block["type"] == "text"
    assert len(block["text"].split()) == 12

    status, events = await _events(c, _body("shape"))
    assert status == 200, events
    names = [n for n, _ in events]
    assert names[0] == "message_start"
    assert names[1] == "content_block_start"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert _text_of(events) == block["text"]  # the simulator's tokens follow from the prompt
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 12
    start = events[0][1]["message"]
    assert start["content"] == []
    assert start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_warm_engine_wins_the_race(make_cluster: MakeCluster, stream: bool) -> None:
    # A deadline no loaded machine reaches: an expired probe is another path (its own tests).
    c = await make_cluster(decoders=2, routing={"race": "always", "probe_deadline_ms": 10_000})
    warm = _body("warm", max_tokens=4)
    status, _ = await c.complete(warm, MESSAGES)  # d0 or d1 now holds the prompt
    assert status == 200
    if stream:
        status, events = await _events(c, warm)
        assert status == 200, events
    else:
        status, out = await c.complete(warm, MESSAGES)
        assert status == 200, out
    assert c.routes().get("probe_hit", 0) >= 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_cold_prompt_is_rejected_then_split_over_prefill_and_decode(
    make_cluster: MakeCluster, stream: bool
) -> None:
    c = await make_cluster(decoders=2, prefillers=1, per_backend=PD_PREFERRED)
    body = {**_body("split", max_tokens=8), "system": long_prompt("split", 300)}
    if stream:
        status, events = await _events(c, body)
        assert status == 200, events
        text = _text_of(events)
    else:
        status, out = await c.complete(body, MESSAGES)
        assert status == 200, out
        text = out["content"][0]["text"]
    assert len(text.split()) == 8
    assert c.routes() == {"probe_hit": 0, "pd": 1, "direct": 0}
    assert c.router_metric("cachehit_router_probe_rejections_total", backend="d0") == 1
    ext = await c.engine_metrics("vllm:external_prefix_cache_hits_total")
    assert max(ext["d0"], ext["d1"]) >= 300 - 16  # the decoder pulled the prompt from p0


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_dying_mid_answer_is_resumed_into_one_message(make_cluster: MakeCluster, stream: bool) -> None:
    c = await make_cluster(decoders=2, per_engine={"d0": {"faults": FaultConfig(exit_after_tokens=25)}})
    body = _body("dies", max_tokens=60)
    # The prompt is cached on d0 first, so the answer starts there and d0 dies mid-answer.
    async with c.session.post(
        c.engines["d0"].url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "system", "content": body["system"]}, *body["messages"]],
            "max_tokens": 1,
        },
    ) as r:
        assert r.status == 200
    if stream:
        status, events = await _events(c, body)
        assert status == 200, events
        text = _text_of(events)
        assert [n for n, _ in events].count("message_start") == 1
        assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
        assert events[-2][1]["usage"]["output_tokens"] == 60
    else:
        status, out = await c.complete(body, MESSAGES)
        assert status == 200, out
        text = out["content"][0]["text"]
        assert out["stop_reason"] == "max_tokens"
        assert out["usage"]["output_tokens"] == 60
    assert len(text.split()) == 60
    assert c.router_metric("cachehit_router_resumes_total", reason="failure") == 1


async def test_client_kv_transfer_params_and_threshold_never_reach_an_engine(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    body = _body(
        "strip",
        max_tokens=3,
        kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.0.0.1"},
        cache_hit_threshold=1.0,
        vllm_xargs={"cache_hit_threshold": 1.0, "kv_transfer_params": {"remote_host": "10.0.0.1"}},
    )
    # Were the threshold kept, the cold engine would reject; were the KV parameters kept,
    # the simulator would try to pull the prompt from that host.
    status, out = await c.complete(body, MESSAGES)
    assert status == 200, out
    assert out["usage"]["output_tokens"] == 3
    assert "kv_transfer_params" not in out


async def test_bad_bodies_get_anthropics_error_shape(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    status, out = await c.complete({"model": MODEL, "messages": []}, MESSAGES)
    assert status == 400
    assert out["type"] == "error"
    assert "max_tokens" in out["error"]["message"]
    status, out = await c.complete(_body("nomodel", model="no-such-model"), MESSAGES)
    assert status == 404
    assert out["type"] == "error"
    assert out["error"]["type"] == "NotFoundError"


async def test_the_anthropic_sdk_reads_the_answers(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2)
    client = anthropic.AsyncAnthropic(base_url=c.url, api_key="unused", max_retries=0)
    async with client:
        msg = await client.messages.create(
            model=MODEL, max_tokens=8, system=long_prompt("sdk", 80), messages=[{"role": "user", "content": "hi"}]
        )
        assert msg.stop_reason == "max_tokens"
        assert msg.usage.output_tokens == 8
        first = msg.content[0]
        assert first.type == "text"
        async with client.messages.stream(
            model=MODEL, max_tokens=8, system=long_prompt("sdk", 80), messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == first.text
        assert final.stop_reason == "max_tokens"
        assert final.usage.output_tokens == 8
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
