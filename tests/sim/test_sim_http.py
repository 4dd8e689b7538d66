"""The OpenAI surface: vLLM 0.32's JSON and SSE shapes, sampling fields, errors."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from engine_launcher.sim import tokenizer as tok
from support.sim_http import MakeEngine, post

PROMPT = "the first river of the world was known to all people"

COMPLETION_KEYS = {
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
}
COMPLETION_CHOICE_KEYS = {
    "index",
    "text",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "prompt_logprobs",
    "prompt_token_ids",
    "routed_experts",
}


async def test_completion_non_streaming_shape(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    status, body = await post(
        http,
        eng.url + "/v1/completions",
        {"model": "sim-model", "prompt": PROMPT, "max_tokens": 7, "return_token_ids": True},
    )
    assert status == 200
    assert set(body) == COMPLETION_KEYS
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == "sim-model"
    assert body["system_fingerprint"].startswith("vllm-0.32.0-")
    (choice,) = body["choices"]
    assert set(choice) == COMPLETION_CHOICE_KEYS
    assert choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None
    assert len(choice["token_ids"]) == 7
    assert choice["text"] == tok.decode(choice["token_ids"])
    assert choice["prompt_token_ids"] == tok.encode(PROMPT)
    u = body["usage"]
    assert u["prompt_tokens"] == len(tok.encode(PROMPT))
    assert u["completion_tokens"] == 7
    assert u["total_tokens"] == u["prompt_tokens"] + 7
    assert u["prompt_tokens_details"]["cached_tokens"] == 0
    assert body["kv_transfer_params"] is None


async def test_token_ids_absent_unless_asked(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    _, body = await post(http, eng.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert body["choices"][0]["token_ids"] is None
    assert body["choices"][0]["prompt_token_ids"] is None


async def test_same_request_gives_the_same_output_and_seed_changes_it(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine()
    url = eng.url + "/v1/completions"
    a = (await post(http, url, {"prompt": PROMPT, "max_tokens": 12}))[1]["choices"][0]["text"]
    b = (await post(http, url, {"prompt": PROMPT, "max_tokens": 12}))[1]["choices"][0]["text"]
    c = (await post(http, url, {"prompt": PROMPT, "max_tokens": 12, "seed": 7}))[1]
    assert a == b != c["choices"][0]["text"]


async def test_second_identical_prompt_reports_cached_tokens(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine(block_size=4)
    url = eng.url + "/v1/completions"
    ids = list(range(300, 322))  # 22 token ids
    await post(http, url, {"prompt": ids, "max_tokens": 1})
    _, body = await post(http, url, {"prompt": ids, "max_tokens": 1})
    # (22 - 1) // 4 whole blocks: the last token is always recomputed.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 20


async def test_completion_stream_shape(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    status, events = await post(
        http,
        eng.url + "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 5,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    ids: list[int] = []
    for i, c in enumerate(chunks):
        assert set(c) == {"id", "object", "created", "model", "choices"}
        assert c["object"] == "text_completion"
        (ch,) = c["choices"]
        assert set(ch) == {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"}
        # prompt_token_ids only on the first chunk.
        assert (ch["prompt_token_ids"] is not None) == (i == 0)
        ids += ch["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(ids)
    assert len(ids) == 5
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["system_fingerprint"].startswith("vllm-")
    assert len({c["id"] for c in events[:-1]}) == 1


async def test_stream_without_usage_puts_fingerprint_on_the_last_chunk(
    make_engine: MakeEngine, http: aiohttp.ClientSession
) -> None:
    eng = await make_engine()
    _, events = await post(http, eng.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True})
    chunks = events[:-1]
    assert "system_fingerprint" in chunks[-1]
    assert all("system_fingerprint" not in c for c in chunks[:-1])
    assert all(c["choices"][0]["token_ids"] is None for c in chunks)


async def test_continuous_usage_stats(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    _, events = await post(
        http,
        eng.url + "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    counts = [c["usage"]["completion_tokens"] for c in events[:-2]]
    assert counts == sorted(counts)
    assert counts[-1] == 4


async def test_chat_non_streaming_shape(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    msgs = [{"role": "user", "content": "hello there"}]
    status, body = await post(
        http, eng.url + "/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 4, "return_token_ids": True}
    )
    assert status == 200
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["prompt_token_ids"] == tok.encode(tok.render_chat(msgs))
    (ch,) = body["choices"]
    assert ch["message"]["role"] == "assistant"
    assert ch["message"]["content"] == tok.decode(ch["token_ids"])
    assert "tool_calls" not in ch["message"]
    assert body["usage"]["completion_tokens"] == 4
    for key in ("kv_transfer_params", "prompt_logprobs", "system_fingerprint", "service_tier"):
        assert key in body


async def test_chat_stream_starts_with_a_role_chunk(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    _, events = await post(
        http,
        eng.url + "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    )
    role, *chunks, usage, done = events
    assert done == "[DONE]"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"]
    assert role["object"] == "chat.completion.chunk"
    assert "token_ids" not in role["choices"][0]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "stop_reason" in chunks[-1]["choices"][0]
    assert usage["usage"]["completion_tokens"] == 3
    assert usage["choices"] == []


async def test_prompt_as_token_ids_and_batched_forms(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    url = eng.url + "/v1/completions"
    ids = tok.encode(PROMPT)
    for prompt in (ids, [ids], [PROMPT]):
        status, body = await post(http, url, {"prompt": prompt, "max_tokens": 1, "return_token_ids": True})
        assert status == 200
        assert body["choices"][0]["prompt_token_ids"] == ids


async def test_stop_string_ends_and_trims_the_output(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    url = eng.url + "/v1/completions"
    _, full = await post(http, url, {"prompt": PROMPT, "max_tokens": 30})
    text = full["choices"][0]["text"]
    stop = text.split(" ")[4]  # a word from the middle of the output
    cut = text.index(" " + stop)
    _, body = await post(http, url, {"prompt": PROMPT, "max_tokens": 30, "stop": [stop]})
    ch = body["choices"][0]
    assert ch["finish_reason"] == "stop"
    assert ch["stop_reason"] == stop
    assert ch["text"] == text[: cut + 1]
    _, body = await post(
        http, url, {"prompt": PROMPT, "max_tokens": 30, "stop": stop, "include_stop_str_in_output": True}
    )
    assert body["choices"][0]["text"] == text[: cut + 1 + len(stop)]
    # Streamed, the text never shows the stop string either.
    _, events = await post(http, url, {"prompt": PROMPT, "max_tokens": 30, "stop": [stop], "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[: cut + 1]


async def test_eos_min_tokens_and_ignore_eos(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(eos_probability=1.0)  # EOS whenever it is allowed
    url = eng.url + "/v1/completions"
    _, body = await post(http, url, {"prompt": PROMPT, "max_tokens": 10, "return_token_ids": True})
    ch = body["choices"][0]
    assert ch["finish_reason"] == "stop"
    assert ch["token_ids"] == [tok.EOS_ID]
    assert ch["text"] == ""
    _, body = await post(http, url, {"prompt": PROMPT, "max_tokens": 10, "min_tokens": 4, "return_token_ids": True})
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == 5
    assert ids[-1] == tok.EOS_ID
    assert tok.EOS_ID not in ids[:4]
    _, body = await post(http, url, {"prompt": PROMPT, "max_tokens": 10, "ignore_eos": True})
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 10


async def test_completion_logprobs(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    _, body = await post(http, eng.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2})
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"][1] == len(lp["tokens"][0])
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=False):
        assert token in top
        assert len(top) == 2


async def test_chat_logprobs(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    _, body = await post(
        http,
        eng.url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 3},
    )
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    assert all(len(c["top_logprobs"]) == 3 and c["bytes"] == list(c["token"].encode()) for c in content)


async def test_models_health_version_metrics(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(model="m1", max_model_len=1024)
    async with http.get(eng.url + "/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "m1"
    assert models["data"][0]["max_model_len"] == 1024
    assert models["data"][0]["owned_by"] == "vllm"
    async with http.get(eng.url + "/health") as r:
        assert r.status == 200
    async with http.get(eng.url + "/version") as r:
        assert (await r.json()) == {"version": "0.32.0"}
    async with http.get(eng.url + "/metrics") as r:
        assert r.status == 200
        assert "vllm:num_requests_running" in await r.text()


BAD = [
    ({"prompt": "x", "max_tokens": "ten"}, "body.max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": ["x"] * 1025}, "prompt"),
    ({"prompt": "x", "n": 0}, None),
    ({"prompt": "x", "n": 16385}, None),
    ({"prompt": "x", "n": 2, "temperature": 0}, None),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": "yes"}, "body.stream"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop": 3}, "body.stop"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt"),
    ({"prompt": 12}, "body.prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "cache_hit_threshold": 1.5}, "cache_hit_threshold"),
    ({"prompt": "x", "cache_hit_threshold": "0.5"}, "cache_hit_threshold"),
    ({"prompt": "x", "vllm_xargs": {"cache_hit_threshold": -0.1}}, "vllm_xargs.cache_hit_threshold"),
    ({"prompt": "x", "kv_transfer_params": [1]}, "body.kv_transfer_params"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    # vLLM's SamplingParams raises these without naming the parameter.
    ({"prompt": "x", "presence_penalty": 2.5}, None),
    ({"prompt": "x", "frequency_penalty": -3}, None),
    ({"prompt": "x", "repetition_penalty": 0}, None),
    ({"prompt": "x", "top_k": -2}, None),
    ({"prompt": "x", "min_p": 1.5}, None),
]


@pytest.mark.parametrize(("body", "param"), BAD)
async def test_bad_input_is_a_400_in_vllm_error_shape(
    make_engine: MakeEngine, http: aiohttp.ClientSession, body: dict[str, Any], param: str | None
) -> None:
    eng = await make_engine(max_model_len=2048)
    status, err = await post(http, eng.url + "/v1/completions", body)
    assert status == 400
    assert set(err) == {"error"}
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["code"] == 400
    assert err["error"]["param"] == param
    assert err["error"]["type"] in ("BadRequestError", "Bad Request")
    assert eng.engine.num_running == 0
    assert eng.engine.num_waiting == 0


async def test_bad_chat_input(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    url = eng.url + "/v1/chat/completions"
    body: dict[str, Any]
    for body in (
        {"messages": []},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        {"messages": "hi"},
    ):
        status, err = await post(http, url, body)
        assert status == 400, body
        assert err["error"]["code"] == 400, body


async def test_invalid_json_is_a_400(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    async with http.post(
        eng.url + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == 400


async def test_unknown_model_is_a_404(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine()
    status, err = await post(http, eng.url + "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    assert err["error"] == {
        "message": "The model `nope` does not exist. Valid aliases: sim-model.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_prompt_longer_than_max_model_len_is_a_400(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(max_model_len=64)
    status, err = await post(http, eng.url + "/v1/completions", {"prompt": list(range(2, 70))})
    assert status == 400
    assert err["error"]["param"] == "input_tokens"
    assert "maximum context length is 64 tokens" in err["error"]["message"]


async def test_max_tokens_is_clamped_to_the_context(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    eng = await make_engine(max_model_len=64)
    status, body = await post(http, eng.url + "/v1/completions", {"prompt": list(range(2, 62)), "max_tokens": 20})
    assert status == 200
    assert body["usage"]["completion_tokens"] == 4
