"""Resume: a preempted decode (cache gone) or a dead engine mid-stream; the client sees one answer."""

import asyncio

import pytest

from engine_launcher.sim import FaultConfig
from support.cluster import MODEL, PD_PREFERRED, Cluster, MakeCluster, long_prompt


async def _preempting_cluster(make_cluster: MakeCluster) -> Cluster:
    # One decoder with a tiny KV cache: 4 concurrent long generations cannot all fit, so the
    # engine preempts; the guard threshold on the prefill/decode legs makes it hand a
    # preempted request back.
    return await make_cluster(
        decoders=1,
        prefillers=1,
        per_backend=PD_PREFERRED,
        routing={"decode_guard_threshold": 0.3, "max_resumes": 20},
        per_engine={"d0": {"num_gpu_blocks": 48, "block_size": 16}},
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_preempted_requests_resume_into_one_full_answer(make_cluster: MakeCluster, stream: bool) -> None:
    c = await _preempting_cluster(make_cluster)
    max_tokens = 150
    bodies = [{"model": MODEL, "prompt": long_prompt(f"pre{i}", 100), "max_tokens": max_tokens} for i in range(4)]
    if stream:
        results = await asyncio.gather(*(c.stream({**b, "stream_options": {"include_usage": True}}) for b in bodies))
        for status, events in results:
            assert status == 200, (status, events[-3:])
            assert events[-1] == "[DONE]", (status, events[-3:])
            chunks = [e for e in events[:-1]]
            assert chunks[-1]["usage"]["completion_tokens"] == max_tokens, chunks[-2:]
            finishes = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
            assert finishes.count("length") == 1
            assert "cache_threshold" not in finishes
            assert len({ch["id"] for ch in chunks}) == 1
    else:
        answers = await asyncio.gather(*(c.complete(b) for b in bodies))
        for status, out in answers:
            assert status == 200, out
            assert out["usage"]["completion_tokens"] == max_tokens, out
            assert out["choices"][0]["finish_reason"] == "length", out
    assert c.router_metric("cachehit_router_resumes_total", reason="preempted") >= 1
    assert await c.wait_idle(10) == {"d0": 0, "p0": 0}


async def test_resumed_answer_equals_an_uninterrupted_one_in_length_and_prefix(make_cluster: MakeCluster) -> None:
    """Text before the interruption is kept verbatim: the continuation starts from it."""
    c = await _preempting_cluster(make_cluster)
    bodies = [
        {"model": MODEL, "prompt": long_prompt(f"cont{i}", 100), "max_tokens": 150, "return_token_ids": True}
        for i in range(4)
    ]
    results = await asyncio.gather(*(c.complete(b) for b in bodies))
    for status, out in results:
        assert status == 200, out
        ch = out["choices"][0]
        assert len(ch["token_ids"]) == 150
        assert len(ch["prompt_token_ids"]) == 100


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_dying_mid_stream_is_resumed_elsewhere(make_cluster: MakeCluster, stream: bool) -> None:
    c = await make_cluster(
        decoders=2,
        prefillers=0,
        routing={"race": "always"},
        per_engine={"d0": {"faults": FaultConfig(exit_after_tokens=30)}},
    )
    prompt = long_prompt("dies", 200)
    # Warm d0 so the probe race picks it (cache hit), then it dies after 30 more tokens.
    async with c.session.post(
        c.engines["d0"].url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
    ) as r:
        assert r.status == 200
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 80}
    if stream:
        status, events = await c.stream({**body, "stream_options": {"include_usage": True}})
        assert status == 200
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 80
        assert not any("error" in e for e in events[:-1])
    else:
        status, out = await c.complete(body)
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 80
    assert c.routes()["probe_hit"] == 1
    assert c.router_metric("cachehit_router_resumes_total", reason="failure") == 1
    assert c.engines["d1"].engine.num_running == 0


async def test_resume_bound_ends_with_a_clear_error(make_cluster: MakeCluster) -> None:
    c = await make_cluster(
        decoders=1,
        prefillers=0,
        routing={"max_resumes": 0},
        per_engine={"d0": {"faults": FaultConfig(exit_after_tokens=10)}},
    )
    status, events = await c.stream({"model": MODEL, "prompt": long_prompt("bound", 50), "max_tokens": 50})
    assert status == 200
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == 502
    assert "max_resumes" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_answer_resumed_through_completions_reads_as_one_chat_answer(
    make_cluster: MakeCluster, stream: bool
) -> None:
    c = await make_cluster(decoders=2, prefillers=0, per_engine={"d0": {"faults": FaultConfig(exit_after_tokens=25)}})
    msgs = [{"role": "system", "content": long_prompt("chatdies", 150)}, {"role": "user", "content": "go on"}]
    async with c.session.post(
        c.engines["d0"].url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1}
    ) as r:
        assert r.status == 200
    body = {"model": MODEL, "messages": msgs, "max_tokens": 60}
    if stream:
        status, events = await c.stream({**body, "stream_options": {"include_usage": True}}, "/v1/chat/completions")
        assert status == 200
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert len({ch["id"] for ch in chunks}) == 1
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert sum(1 for d in deltas if "role" in d) == 1
        text = "".join(d.get("content") or "" for d in deltas)
        assert chunks[-1]["usage"]["completion_tokens"] == 60
        assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "length"
    else:
        status, out = await c.complete(body, "/v1/chat/completions")
        assert status == 200, out
        assert out["object"] == "chat.completion"
        text = out["choices"][0]["message"]["content"]
        assert out["usage"]["completion_tokens"] == 60
    assert len(text.split()) == 60  # the simulator's tokens are words with a leading space
    assert c.router_metric("cachehit_router_resumes_total", reason="failure") == 1
