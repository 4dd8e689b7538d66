"""Engines that break the protocol mid-answer: the router resumes or ends cleanly, never 500.

The misbehaving engine here is a few lines of aiohttp speaking vLLM's stream shapes (with
the simulator's tokenizer, so token ids agree with the real simulated engine beside it);
neither vLLM nor the simulator produces these faults on purpose.
"""

import asyncio
from typing import Any

import orjson
import pytest
from aiohttp import web

from engine_launcher.sim import tokenizer as tok
from router.config.parse import parse_config
from router.server.app import ROUTER_KEY, build_app
from support.cluster import MODEL, MakeCluster, long_prompt
from support.ports import serve_on_free_port


def _chunk(text_ids: list[int], prompt_ids: list[int] | None = None, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "text": "".join(tok.token_text(i) for i in text_ids),
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": text_ids,
    }
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
    return (
        b"data: "
        + orjson.dumps(
            {
                "id": "cmpl-bad",
                "object": "text_completion",
                "created": 1,
                "model": MODEL,
                "choices": [choice],
                "usage": None,
            }
        )
        + b"\n\n"
    )


async def _bad_engine(mode: str) -> tuple[web.AppRunner, str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt_ids = tok.encode(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        words = [tok.encode(" the")[0], tok.encode(" of")[0], tok.encode(" and")[0]]
        if mode == "done-only":  # no token, no finish: only the end of the stream
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if mode == "over-budget":  # ignores max_tokens: three times the budget, then a clean end
            n = 3 * body["max_tokens"]
            for i in range(n):
                await resp.write(_chunk(words[i % 3 : i % 3 + 1], prompt_ids if i == 0 else None))
            await resp.write(_chunk([], finish="length") + b"data: [DONE]\n\n")
            return resp
        await resp.write(_chunk(words[:1], prompt_ids))
        await resp.write(_chunk(words[1:2]))
        if mode == "malformed":
            await resp.write(b'data: {"choices": "not a list", "id": 3}\n\n')
            await asyncio.sleep(5)  # the router must not wait for more
        else:  # finished, then the connection dies before usage and [DONE]
            await resp.write(_chunk(words[2:3], finish="length"))
        assert request.transport is not None  # the connection is open while it answers
        request.transport.close()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    return await serve_on_free_port(app)


async def _router(backends: list[dict[str, Any]], routing: dict[str, Any] | None = None) -> tuple[web.AppRunner, str]:
    cfg = parse_config(
        {"server": {"port": 0}, "backends": backends, "routing": routing or {}, "health": {"scrape_interval_s": 30}}
    )
    return await serve_on_free_port(build_app(cfg, start_engines=False), cancel_handlers=True)


@pytest.mark.parametrize("stream", [False, True])
async def test_malformed_chunk_mid_answer_is_resumed_on_another_engine(make_cluster: MakeCluster, stream: bool) -> None:
    healthy = await make_cluster(decoders=1)  # d0: a real simulated engine
    bad_runner, bad_url = await _bad_engine("malformed")
    # Probe race on every request: the bad engine accepts at once (it streams text), d0
    # rejects the cold prompt.
    router, url = await _router(
        [{"name": "bad", "url": bad_url}, {"name": "d0", "url": healthy.engines["d0"].url}], {"race": "always"}
    )
    try:
        body = {"model": MODEL, "prompt": long_prompt("mal", 40), "max_tokens": 12, "stream": stream}
        async with healthy.session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            raw = await r.read()
        if stream:
            events = [l[6:] for l in raw.split(b"\n") if l.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"
            chunks = [orjson.loads(e) for e in events[:-1]]
            assert not any("error" in c for c in chunks)
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        else:
            out = orjson.loads(raw)
            text = out["choices"][0]["text"]
            assert out["usage"]["completion_tokens"] == 12, out
        # Two tokens came from the bad engine, ten from the resume on d0.
        assert text.startswith(" the of")
        assert len(text.split()) == 12
    finally:
        await router.cleanup()
        await bad_runner.cleanup()


async def test_answer_finished_before_the_connection_broke_is_not_resumed(make_cluster: MakeCluster) -> None:
    healthy = await make_cluster(decoders=1)
    bad_runner, bad_url = await _bad_engine("finish-then-break")
    router, url = await _router([{"name": "bad", "url": bad_url}], {"strategy": "round_robin"})
    try:
        body = {"model": MODEL, "prompt": long_prompt("fin", 40), "max_tokens": 3, "stream": True}
        async with healthy.session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            raw = await r.read()
        events = [l[6:] for l in raw.split(b"\n") if l.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " the of and"
    finally:
        await router.cleanup()
        await bad_runner.cleanup()


def _failures(router: web.AppRunner, backend: str) -> int:
    """What the engine's circuit breaker has counted against it."""
    registry = router.app[ROUTER_KEY].registry
    assert registry is not None  # the router has started
    return registry.states[backend].consecutive_failures


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_that_sends_only_done_is_an_error_not_an_empty_success(
    make_cluster: MakeCluster, stream: bool
) -> None:
    healthy = await make_cluster(decoders=1)  # for its client session
    bad_runner, bad_url = await _bad_engine("done-only")
    router, url = await _router([{"name": "bad", "url": bad_url}], {"strategy": "round_robin", "max_retries": 0})
    try:
        body = {"model": MODEL, "prompt": long_prompt("done", 20), "max_tokens": 8, "stream": stream}
        async with healthy.session.post(url + "/v1/completions", json=body) as r:
            raw = await r.read()
            assert r.status == 502, raw
        assert b"finish_reason" in raw
        assert _failures(router, "bad") >= 1
    finally:
        await router.cleanup()
        await bad_runner.cleanup()


async def test_an_engine_past_max_tokens_ends_in_an_error_event_after_the_budget(make_cluster: MakeCluster) -> None:
    healthy = await make_cluster(decoders=1)  # for its client session
    bad_runner, bad_url = await _bad_engine("over-budget")
    router, url = await _router([{"name": "bad", "url": bad_url}], {"strategy": "round_robin"})
    try:
        body = {"model": MODEL, "prompt": long_prompt("budget", 20), "max_tokens": 16, "stream": True}
        async with healthy.session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200  # the stream had started: the error travels as an event
            raw = await r.read()
        events = [l[6:] for l in raw.split(b"\n") if l.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert "max_tokens" in chunks[-1]["error"]["message"]
        tokens = [t for c in chunks[:-1] for t in c["choices"][0]["text"].split()]
        assert len(tokens) == 16  # nothing past the budget reached the client
        assert _failures(router, "bad") >= 1
    finally:
        await router.cleanup()
        await bad_runner.cleanup()


async def test_a_non_streamed_answer_past_max_tokens_is_an_error(make_cluster: MakeCluster) -> None:
    healthy = await make_cluster(decoders=1)  # for its client session
    bad_runner, bad_url = await _bad_engine("over-budget")
    # probe: a non-streaming client's answer is read from the engine's stream too.
    router, url = await _router([{"name": "bad", "url": bad_url}], {"race": "always"})
    try:
        body = {"model": MODEL, "prompt": long_prompt("budget", 20), "max_tokens": 16}
        async with healthy.session.post(url + "/v1/completions", json=body) as r:
            raw = await r.read()
            assert r.status == 502, raw
        assert b"max_tokens" in raw
        assert _failures(router, "bad") >= 1
    finally:
        await router.cleanup()
        await bad_runner.cleanup()
