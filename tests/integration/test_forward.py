"""vLLM's other routes through the router (router/server/forward.py), on simulated engines:
the engine's own JSON comes back, with the router's auth, limits, model routing, retries
and request ids; audio uploads are streamed, not held."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from support.cluster import MODEL, Cluster, FaultConfig, MakeCluster
from support.polling import eventually


async def _post(
    c: Cluster, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any, CIMultiDict[str]]:
    async with await c.post(path, body, headers=headers or {}) as r:
        return r.status, orjson.loads(await r.read()), r.headers.copy()


async def _direct(c: Cluster, name: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with c.session.post(c.engines[name].url + path, json=body) as r:
        return r.status, await r.json()


async def test_embeddings_tokenize_detokenize_answer_as_the_engine_does(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2)
    body = {"model": MODEL, "input": ["the river stone", "a river"]}
    status, got, headers = await _post(c, "/v1/embeddings", body)
    assert status == 200, got
    _, direct = await _direct(c, "d0", "/v1/embeddings", body)
    assert got["object"] == "list"
    assert got["model"] == MODEL
    assert got["id"].startswith("embd-")
    assert [d["embedding"] for d in got["data"]] == [d["embedding"] for d in direct["data"]]
    assert [d["index"] for d in got["data"]] == [0, 1]
    assert got["usage"] == direct["usage"]
    assert got["usage"]["prompt_tokens"] > 0
    assert headers["Content-Type"].startswith("application/json")

    # base64, what the OpenAI SDK asks for: the float32 bytes of the same vector.
    status, b64, _ = await _post(c, "/v1/embeddings", {**body, "encoding_format": "base64"})
    assert status == 200
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == got["data"][0]["embedding"]

    status, tokens, _ = await _post(
        c, "/tokenize", {"model": MODEL, "prompt": "the river stone", "return_token_strs": True}
    )
    assert status == 200
    assert (
        tokens
        == (
            await _direct(
                c, "d1", "/tokenize", {"model": MODEL, "prompt": "the river stone", "return_token_strs": True}
            )
        )[1]
    )
    assert tokens["count"] == len(tokens["tokens"]) == 3
    assert tokens["token_strs"] == ["the", " river", " stone"]
    status, text, _ = await _post(c, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert (status, text) == (200, {"prompt": "the river stone"})

    async with c.session.get(c.url + "/version") as r:
        assert r.status == 200
        assert await r.json() == {"version": "0.32.0"}
    assert c.router_metric("cachehit_router_requests_total", route="forward", status="200") == 5


async def test_engine_errors_pass_through_and_unknown_models_are_404(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    status, err, _ = await _post(c, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404
    assert err["error"]["param"] == "model"
    assert err["error"]["message"] == f"The model `nope` does not exist. Valid aliases: {MODEL}."
    # The engine's own 400, as it wrote it.
    status, err, _ = await _post(c, "/detokenize", {"model": MODEL, "tokens": "oops"})
    assert status == 400
    assert err["error"]["param"] == "tokens"
    status, err, _ = await _post(
        c, "/tokenize", {"model": MODEL, "prompt": "x"}, headers={"Content-Type": "application/json"}
    )
    assert status == 200
    async with c.session.post(
        c.url + "/v1/embeddings", data=b"{not json", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "BadRequestError"


async def test_auth_and_body_limit_hold_on_forwarded_routes(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1, server={"api_keys": ["k1"], "max_body_bytes": 2048})
    status, _, headers = await _post(c, "/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 401
    assert headers.get("WWW-Authenticate") == "Bearer"
    auth = {"Authorization": "Bearer k1"}
    status, _, _ = await _post(c, "/v1/embeddings", {"model": MODEL, "input": "x"}, headers=auth)
    assert status == 200
    status, _err, _ = await _post(c, "/v1/embeddings", {"model": MODEL, "input": "x" * 4096}, headers=auth)
    assert status == 413
    async with c.session.get(c.url + "/version") as r:
        assert r.status == 401


async def test_least_loaded_engine_and_retry_on_a_failing_one(make_cluster: MakeCluster) -> None:
    c = await make_cluster(
        decoders=2,
        per_engine={"d0": {"faults": FaultConfig(error_rate=1.0)}},
        routing={"max_retries": 2},
        health={"failure_threshold": 100},
    )
    for _ in range(6):
        status, got, _ = await _post(c, "/v1/embeddings", {"model": MODEL, "input": "x"})
        assert status == 200, got
    # Every answer came from d1; each request that tried d0 first was retried there.
    assert c.router_metric("cachehit_router_requests_total", route="forward", status="200") == 6
    assert c.router_metric("cachehit_router_upstream_errors_total", backend="d0", kind="status") >= 1
    assert c.router_metric_or_zero("cachehit_router_upstream_errors_total", backend="d1", kind="status") == 0

    # Least loaded: with d1 busy (requests in flight), a forwarded request goes to d0.
    c2 = await make_cluster(decoders=2)
    c2.registry.states["d1"].inflight += 5
    try:
        async with c2.session.post(
            c2.url + "/tokenize", json={"model": MODEL, "prompt": "a"}, headers={"X-Request-Id": "which-one"}
        ) as r:
            assert r.status == 200
    finally:
        c2.registry.states["d1"].inflight -= 5
    assert c2.router_metric("cachehit_router_requests_total", route="forward", status="200") == 1


async def test_only_engine_failing_gives_its_500(make_cluster: MakeCluster) -> None:
    c = await make_cluster(
        decoders=1, per_engine={"d0": {"faults": FaultConfig(error_rate=1.0)}}, health={"failure_threshold": 100}
    )
    status, err, _ = await _post(c, "/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 500
    assert "fault injection" in err["error"]["message"]


async def test_x_request_id_names_the_answer_and_comes_back(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    status, got, headers = await _post(
        c, "/v1/embeddings", {"model": MODEL, "input": "x"}, headers={"X-Request-Id": "client-id-7"}
    )
    assert status == 200
    assert got["id"] == "embd-client-id-7"
    assert headers["X-Request-Id"] == "client-id-7"
    # Generation: vLLM names the answer cmpl-<X-Request-Id>, before the body's request_id.
    for stream in (False, True):
        async with await c.post(
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream, "request_id": "body-id"},
            headers={"X-Request-Id": "hdr-id"},
        ) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] == "hdr-id"
            raw = await r.read()
        first = orjson.loads(raw.split(b"data: ")[1]) if stream else orjson.loads(raw)
        assert first["id"] == "cmpl-hdr-id"
    status, err, _ = await _post(
        c, "/v1/completions", {"model": MODEL, "prompt": "hi"}, headers={"X-Request-Id": "has space"}
    )
    assert status == 400
    assert err["error"]["param"] == "X-Request-Id"


async def test_audio_upload_is_streamed_to_the_engine_not_held(make_cluster: MakeCluster) -> None:
    """The engine reads the file's first megabyte while the client is still sending: the
    router streams the upload; and an upload larger than max_body_bytes is fine."""
    c = await make_cluster(decoders=1, server={"max_body_bytes": 4096})
    aux = c.engines["d0"].server.aux
    chunk = b"\x01" * (256 * 1024)
    released = asyncio.Event()

    async def audio() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield chunk
        released.set()
        # Only once the engine has received part of the file does the rest follow.
        await eventually(
            lambda: aux.upload_bytes >= 512 * 1024, 10, "the engine receiving the first half of the file", interval=0.01
        )
        for _ in range(4):
            yield chunk

    form = aiohttp.FormData()
    form.add_field("model", MODEL)
    form.add_field("file", audio(), filename="a.wav", content_type="audio/wav")
    async with c.session.post(c.url + "/v1/audio/transcriptions", data=form) as r:
        body = await r.json()
        assert r.status == 200, body
    assert body == {"text": f"{8 * len(chunk)} bytes of audio", "usage": {"type": "duration", "seconds": 66}}

    form = aiohttp.FormData()
    form.add_field("model", "other-model")
    form.add_field("file", b"abc", filename="a.wav", content_type="audio/wav")
    async with c.session.post(c.url + "/v1/audio/translations", data=form) as r:
        assert r.status == 404
        assert (await r.json())["error"]["param"] == "model"


async def test_upload_past_max_upload_bytes_is_413(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1, server={"max_upload_bytes": 100_000})

    async def audio() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"\x00" * 50_000

    form = aiohttp.FormData()
    form.add_field("model", MODEL)
    form.add_field("file", audio(), filename="a.wav", content_type="audio/wav")
    async with c.session.post(c.url + "/v1/audio/transcriptions", data=form) as r:
        assert r.status == 413, await r.read()
