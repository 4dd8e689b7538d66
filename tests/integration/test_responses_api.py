"""`/v1/responses` through the router on simulated engines: the engine holding the
prompt's KV cache wins a race of one-token chat probes and answers with its own Responses
body or stream; nobody holding it, the fallback's engine does; the `openai` SDK's
responses client reads both."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest

from engine_launcher.sim import FaultConfig
from support.cluster import MODEL, Cluster, MakeCluster, long_prompt

RESPONSES = "/v1/responses"


def _body(tag: str, max_output_tokens: int = 10, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "instructions": long_prompt(tag, 150),
        "input": "go on",
        "max_output_tokens": max_output_tokens,
        **extra,
    }


async def _warm(c: Cluster, engine: str, body: dict[str, Any]) -> None:
    """The prompt cached on `engine` (a chat request of the same messages)."""
    chat = {
        "model": MODEL,
        "messages": [{"role": "system", "content": body["instructions"]}, {"role": "user", "content": body["input"]}],
        "max_tokens": 1,
    }
    async with c.session.post(c.engines[engine].url + "/v1/chat/completions", json=chat) as r:
        assert r.status == 200


async def _direct(c: Cluster, engine: str, body: dict[str, Any]) -> dict[str, Any]:
    async with c.session.post(c.engines[engine].url + RESPONSES, json=body) as r:
        assert r.status == 200
        out: dict[str, Any] = orjson.loads(await r.read())
        return out


def _text(out: dict[str, Any]) -> str:
    return "".join(part["text"] for item in out["output"] for part in item["content"])


@pytest.mark.parametrize("warm_on", ["d0", "d1"])
async def test_the_engine_holding_the_prompt_answers(make_cluster: MakeCluster, warm_on: str) -> None:
    c = await make_cluster(decoders=2, routing={"race": "always"})
    body = _body(f"held{warm_on}")
    await _warm(c, warm_on, body)
    before = await c.engine_metric(warm_on, "vllm:request_success_total")
    status, out = await c.complete(body, RESPONSES)
    assert status == 200, out
    assert out["object"] == "response"
    assert out["id"].startswith("resp_")
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["usage"]["output_tokens"] == 10
    assert c.routes().get("probe_hit", 0) == 1
    # The probe and the answer both ran there.
    assert await c.engine_metric(warm_on, "vllm:request_success_total") == before + 2
    direct = await _direct(c, warm_on, body)
    assert _text(out) == _text(direct)


async def test_nobody_holding_it_the_fallback_engine_answers(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, routing={"race": "always"})
    status, out = await c.complete(_body("cold"), RESPONSES)
    assert status == 200, out
    assert out["usage"]["output_tokens"] == 10
    assert c.routes().get("probe_hit", 0) == 0


async def test_a_stream_is_the_engines_own(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, routing={"race": "always"})
    body = _body("stream", stream=True)
    async with await c.post(RESPONSES, body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [orjson.loads(block.split("data: ", 1)[1]) for block in raw.split("\n\n") if block.strip()]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == _text(events[-1]["response"])
    assert len(text.split()) == 10


async def test_router_fields_are_stripped_and_threshold_zero_is_sent(make_cluster: MakeCluster) -> None:
    # An engine-wide default of 1.0 would reject every cold prompt: the router's explicit
    # T = 0 on the placed request overrides it, and the client's own threshold and KV
    # parameters never arrive.
    c = await make_cluster(decoders=1, sim={"global_cache_hit_threshold": 1.0})
    body = _body(
        "strip",
        kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.0.0.1"},
        vllm_xargs={"cache_hit_threshold": 1.0},
        cache_hit_threshold=1.0,
    )
    status, out = await c.complete(body, RESPONSES)
    assert status == 200, out
    assert out["usage"]["output_tokens"] == 10


async def test_a_failure_before_the_first_byte_is_retried_elsewhere(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, per_engine={"d0": {"faults": FaultConfig(error_rate=1.0)}})
    for i in range(4):
        status, out = await c.complete(_body(f"retry{i}", 3), RESPONSES)
        assert status == 200, out


async def test_the_openai_sdk_responses_client(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2)
    async with openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0) as client:
        resp = await client.responses.create(
            model=MODEL, instructions=long_prompt("sdk", 60), input="hello", max_output_tokens=6
        )
        assert resp.status == "incomplete"
        assert resp.usage is not None
        assert resp.usage.output_tokens == 6
        stream = await client.responses.create(
            model=MODEL, instructions=long_prompt("sdk", 60), input="hello", max_output_tokens=6, stream=True
        )
        deltas, final = [], None
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type == "response.completed":
                final = event.response
        assert final is not None
        assert "".join(deltas) == resp.output_text == final.output_text
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="nope", input="hi", max_output_tokens=2)
