"""n > 1, batched completion prompts, echo and prompt_logprobs through the router: answered
whole by one engine (admission.RequestSpec.whole, forward.Forwarder.forward_generation)
exactly as the engine answers them directly, streamed or not."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from support.cluster import MODEL, Cluster, FaultConfig, MakeCluster, long_prompt

CHAT = "/v1/chat/completions"


def _same_answer(routed: dict[str, Any], direct: dict[str, Any]) -> None:
    """Equal but for the answer's id and creation time."""
    for a in (routed, direct):
        a.pop("id"), a.pop("created")
        a["usage"]["prompt_tokens_details"] = None  # the second of the two may find the prompt cached
    assert routed == direct


async def _direct(c: Cluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with c.session.post(c.engines["d0"].url + path, json=body) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        return answer


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "the cat sat on", "n": 3, "max_tokens": 5, "logprobs": 2}),
        ("/v1/completions", {"prompt": ["the cat sat", [101, 34, 102], "a dog"], "max_tokens": 4}),
        (
            "/v1/completions",
            {"prompt": ["the cat sat", "a dog ran"], "n": 2, "max_tokens": 3, "return_token_ids": True},
        ),
        ("/v1/completions", {"prompt": "hello there", "echo": True, "max_tokens": 4}),
        ("/v1/completions", {"prompt": "hello there", "prompt_logprobs": 2, "max_tokens": 2}),
        (
            CHAT,
            {
                "messages": [{"role": "user", "content": "hi"}],
                "n": 2,
                "max_tokens": 4,
                "logprobs": True,
                "top_logprobs": 1,
            },
        ),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0, "max_tokens": 2}),
    ],
)
async def test_answered_as_the_engine_answers(make_cluster: MakeCluster, path: str, body: dict[str, Any]) -> None:
    c = await make_cluster(decoders=2)
    body = {"model": MODEL, "seed": 11, **body}
    status, routed = await c.complete(body, path)
    assert status == 200, routed
    _same_answer(routed, await _direct(c, path, body))
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) else [None]
    n = body.get("n", 1)
    assert [ch["index"] for ch in routed["choices"]] == list(range(len(prompts) * n))
    assert c.routes()["direct"] == 1
    assert c.routes()["probe_hit"] == 0


async def test_n_choices_differ_and_usage_counts_the_prompt_once(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    status, out = await c.complete({"model": MODEL, "prompt": "one two three", "n": 4, "max_tokens": 6})
    assert status == 200, out
    texts = [ch["text"] for ch in out["choices"]]
    assert len(set(texts)) == 4  # independent samples
    _, single = await c.complete({"model": MODEL, "prompt": "one two three", "max_tokens": 6})
    assert out["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 24


async def test_echo_puts_the_prompt_first(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    prompt = "echo me please"
    status, out = await c.complete({"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 3})
    assert status == 200
    assert out["choices"][0]["text"].startswith(prompt)
    status, events = await c.stream({"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 3})
    chunks = [e for e in events if e != "[DONE]"]
    assert status == 200
    assert events[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["text"].startswith(prompt)
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == out["choices"][0]["text"]


async def test_streamed_batch_with_n_has_every_index_and_one_usage(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2)
    body = {
        "model": MODEL,
        "prompt": ["first prompt", "second prompt"],
        "n": 2,
        "max_tokens": 5,
        "stream_options": {"include_usage": True},
    }
    async with await c.post("/v1/completions", {**body, "stream": True}, headers={"X-Request-Id": "batch-7"}) as r:
        assert r.status == 200
        assert r.headers["X-Request-Id"] == "batch-7"
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert {ch["id"] for ch in chunks} == {"cmpl-batch-7"}  # named after X-Request-Id, as vLLM does
    texts: dict[int, str] = {}
    for ch in chunks[:-1]:
        (choice,) = ch["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == [0, 1, 2, 3]
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 20
    _, whole = await c.complete({k: v for k, v in body.items() if k != "stream_options"})
    assert usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


async def test_engine_errors_are_relayed_and_failures_retried(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, per_engine={"d0": {"faults": FaultConfig(error_rate=1.0)}})
    # The engine's own validation answer, unchanged: n > 1 is not for greedy sampling.
    status, out = await c.complete({"model": MODEL, "prompt": "x", "n": 2, "temperature": 0})
    assert status == 400, out
    assert out["error"]["message"] == "n must be 1 when using greedy sampling, got 2.", out
    # Checked by the router as vLLM checks it: no prompt_logprobs in a stream.
    status, events = await c.stream({"model": MODEL, "prompt": "x", "prompt_logprobs": 1})
    assert status == 400
    assert events[0]["error"]["param"] == "prompt_logprobs"
    # d0 fails every generation: each request is retried on d1 before its first byte.
    for i in range(4):
        status, out = await c.complete({"model": MODEL, "prompt": long_prompt(f"r{i}", 20), "n": 2, "max_tokens": 2})
        assert status == 200, out
        assert len(out["choices"]) == 2, out
    assert c.router_metric("cachehit_router_requests_total", route="direct", status="200") == 4


async def test_still_rejected(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    for body, param in (
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": ["x", 5]}, "prompt[1]"),
        ({"prompt": "x", "n": 2, "model": "nope"}, "model"),
    ):
        status, out = await c.complete({"model": MODEL, **body})
        assert status in (400, 404), out
        assert out["error"]["param"] == param, out


async def test_a_body_request_id_names_the_answer(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    for rid in ("mine-1", "odd\nid"):
        for n in (1, 2):
            status, out = await c.complete({"model": MODEL, "prompt": "x", "n": n, "max_tokens": 2, "request_id": rid})
            assert status == 200, out
            assert out["id"] == f"cmpl-{rid}", out


async def test_the_race_picks_the_engine_holding_the_prompt(make_cluster: MakeCluster) -> None:
    # The probe strategy races a one-token probe of the prompt and the engine that accepts
    # it serves all n choices.
    c = await make_cluster(decoders=2, routing={"race": "always"})
    for i in range(4):
        holder, other = (f"d{i % 2}", f"d{1 - i % 2}")
        prompt = long_prompt(f"whole{i}", 400)
        async with c.session.post(
            c.engines[holder].url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
        ) as r:
            assert r.status == 200
        before = await c.engine_metrics("vllm:generation_tokens_total")
        body = {"model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 3}
        if i == 3:
            status, events = await c.stream(body)
            assert status == 200
            assert events[-1] == "[DONE]"
        else:
            status, out = await c.complete(body)
            assert status == 200, out
            assert len(out["choices"]) == 2, out
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        after = await c.engine_metrics("vllm:generation_tokens_total")
        # The winner: its probe's one token and the 2 x 3 of the answer; the other rejected.
        assert after[holder] - before[holder] == 7, (i, before, after)
        assert after[other] == before[other], (i, before, after)
    assert c.router_metric("cachehit_router_requests_total", route="probe_hit", status="200") == 4
    assert c.router_metric("cachehit_router_probe_rejections_total") == 4
