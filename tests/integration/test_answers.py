"""Non-streaming answers assembled from streams equal the engine's own non-streaming JSON."""

import asyncio
from typing import Any

import orjson
import pytest

from support.cluster import MODEL, Cluster, MakeCluster, long_prompt

VOLATILE = ("id", "created")


def _strip(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in VOLATILE}


async def _direct(c: Cluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    eng = c.engines["d0"]
    async with c.session.post(eng.url + "/reset_prefix_cache") as r:
        assert r.status == 200
    async with c.session.post(
        eng.url + path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 200
        out: dict[str, Any] = orjson.loads(await r.read())
    async with c.session.post(eng.url + "/reset_prefix_cache") as r:
        assert r.status == 200
    return out


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"return_token_ids": True},
        {"logprobs": 2},
        {"stop": [" the"], "max_tokens": 40},
    ],
)
async def test_completion_matches_engine_field_by_field(make_cluster: MakeCluster, extra: dict[str, Any]) -> None:
    c = await make_cluster(decoders=1)
    body = {"model": MODEL, "prompt": long_prompt("parity", 50), "max_tokens": 10, **extra}
    engine_answer = await _direct(c, "/v1/completions", body)
    status, routed = await c.complete(body)
    assert status == 200, routed
    assert _strip(routed) == _strip(engine_answer)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"return_token_ids": True},
        {"logprobs": True, "top_logprobs": 2},
        {"max_completion_tokens": 7},
    ],
)
async def test_chat_matches_engine_field_by_field(make_cluster: MakeCluster, extra: dict[str, Any]) -> None:
    c = await make_cluster(decoders=1)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": long_prompt("chat", 40)}],
        "max_tokens": 9,
        **extra,
    }
    engine_answer = await _direct(c, "/v1/chat/completions", body)
    status, routed = await c.complete(body, "/v1/chat/completions")
    assert status == 200, routed
    assert _strip(routed) == _strip(engine_answer)


@pytest.mark.parametrize(
    ("path", "prompt"),
    [
        ("/v1/completions", {"prompt": long_prompt("sparity", 50)}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt("cparity", 50)}]}),
    ],
)
async def test_streaming_matches_engine_stream_modulo_ids(
    make_cluster: MakeCluster, path: str, prompt: dict[str, Any]
) -> None:
    c = await make_cluster(decoders=1)
    body = {"model": MODEL, **prompt, "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
    eng = c.engines["d0"]
    async with c.session.post(eng.url + path, json=body) as r:
        raw = await r.read()
    direct = [l[6:] for l in raw.split(b"\n") if l.startswith(b"data: ")]
    await c.session.post(eng.url + "/reset_prefix_cache")
    status, events = await c.stream(body, path)
    assert status == 200
    direct_events: list[Any] = ["[DONE]" if p == b"[DONE]" else orjson.loads(p) for p in direct]
    assert len(events) == len(direct_events)
    for got, want in zip(events, direct_events, strict=False):
        if want == "[DONE]":
            assert got == "[DONE]"
        else:
            assert _strip(got) == _strip(want)


@pytest.mark.parametrize("extra", [{}, {"n": 2}])  # the router's stream, and an engine's relayed
async def test_an_http_1_0_keep_alive_client_gets_the_whole_stream_then_the_close(
    make_cluster: MakeCluster, extra: dict[str, Any]
) -> None:
    """HTTP/1.0 has no chunked body: a stream's end is the connection's end, even when the
    client asked to keep the connection alive (else it waits for more, forever)."""
    c = await make_cluster(decoders=1)
    body = orjson.dumps({"model": MODEL, "prompt": "the cat sat", "max_tokens": 5, "stream": True, **extra})
    host, port = c.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\nContent-Type: application/json\r\n"
    writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    answer = await asyncio.wait_for(reader.read(), 60)  # to the connection's end
    writer.close()
    assert answer.startswith(b"HTTP/1.0 200")
    assert answer.endswith(b"data: [DONE]\n\n")
    assert answer.count(b'"finish_reason":"length"') == (extra.get("n") or 1)
