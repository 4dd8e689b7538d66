"""The cache-hit threshold plugin in a real vLLM 0.32 engine: per-request and global
thresholds, validation, the finish chunk of a rejected stream, prefill legs, metrics.

All tests here share the session's "threshold" engine (conftest.py): global threshold 0.5,
arrival check on, --max-num-seqs 2, NIXL kv_both. Each test uses prompts no other test
sends (a fresh tag first), so the prefix cache only holds what the test itself put there.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from router.engine.wire import PREFILL_REQUEST_PARAMS
from support.real_engine import EngineProcess, post_json, post_sse, scrape_metrics

# Engine start-up (~2-3 min here, shared session fixture) is charged to the first test.
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

WORDS = [
    "river",
    "mountain",
    "garden",
    "winter",
    "summer",
    "morning",
    "evening",
    "city",
    "village",
    "road",
    "bridge",
    "window",
    "light",
    "water",
    "stone",
    "green",
    "blue",
    "red",
    "yellow",
    "quiet",
]


def cold_prompt(items: int = 60) -> str:
    """A prompt of about 2 * items tokens that starts with a never-seen tag."""
    tag = uuid.uuid4().hex[:12]
    return f"{tag} " + " ".join(f"{WORDS[i % len(WORDS)]}{i}" for i in range(items))


def completion(prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True, **kw}


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        "return_token_ids": True,
        **kw,
    }


def assert_rejected_body(body: dict[str, Any], *, chat_api: bool = False) -> None:
    choice = body["choices"][0]
    assert choice["finish_reason"] == "cache_threshold", body
    assert choice["stop_reason"] is None
    if chat_api:
        assert choice["message"]["content"] == ""
    else:
        assert choice["text"] == ""
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] > 0
    assert body["kv_transfer_params"] is None  # the plugin's internal mark never leaks


def test_cold_rejected_then_served_then_accepted(threshold_engine: EngineProcess) -> None:
    url = threshold_engine.base_url
    prompt = cold_prompt()

    status, body = post_json(url, "/v1/completions", completion(prompt, cache_hit_threshold=0.5))
    assert status == 200
    assert_rejected_body(body)
    assert body["choices"][0]["token_ids"] == []
    assert len(body["choices"][0]["prompt_token_ids"]) == body["usage"]["prompt_tokens"]

    status, body = post_json(url, "/v1/completions", completion(prompt, cache_hit_threshold=0))
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["token_ids"]) == 4

    # The prompt's blocks are now in the prefix cache: hit = 96..128 of ~120 tokens.
    status, body = post_json(url, "/v1/completions", completion(prompt, cache_hit_threshold=0.5))
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "length", body
    assert len(body["choices"][0]["token_ids"]) == 4


def test_a_rejection_reports_the_partial_hit_as_cached_tokens(threshold_engine: EngineProcess) -> None:
    """The plugin puts the hit it measured into the rejection's usage, so a router can send
    the fallback to the engine holding the most of the prompt (block size 32)."""
    url = threshold_engine.base_url
    head = cold_prompt(40)
    status, body = post_json(url, "/v1/completions", completion(head, cache_hit_threshold=0))
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "length"
    head_tokens = body["usage"]["prompt_tokens"]
    cached_blocks = head_tokens // 32  # every full block of the prompt (the output fills none)
    longer = head + " " + " ".join(f"tail{i}" for i in range(150))
    status, body = post_json(url, "/v1/completions", completion(longer, cache_hit_threshold=0.9))
    assert status == 200
    assert_rejected_body(body)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, (cached, head_tokens)
    assert cached % 32 == 0, (cached, head_tokens)
    assert cached <= head_tokens, (cached, head_tokens)
    assert cached >= (cached_blocks - 1) * 32, (cached, head_tokens)
    # Streamed: the usage chunk carries the same figure.
    status, events = post_sse(
        url,
        "/v1/completions",
        completion(longer, cache_hit_threshold=0.9, stream=True, stream_options={"include_usage": True}),
    )
    assert status == 200
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


def test_global_threshold_and_per_request_override(threshold_engine: EngineProcess) -> None:
    url = threshold_engine.base_url
    prompt = cold_prompt()
    # No per-request value: the engine-wide 0.5 applies.
    status, body = post_json(url, "/v1/completions", completion(prompt))
    assert status == 200
    assert_rejected_body(body)
    # vllm_xargs carries it too; the top-level field wins when both are present.
    status, body = post_json(
        url, "/v1/completions", completion(prompt, cache_hit_threshold=0.9, vllm_xargs={"cache_hit_threshold": 0})
    )
    assert_rejected_body(body)
    status, body = post_json(url, "/v1/completions", completion(prompt, vllm_xargs={"cache_hit_threshold": 0}))
    assert body["choices"][0]["finish_reason"] == "length"
    # Cached now: the global threshold accepts it.
    status, body = post_json(url, "/v1/completions", completion(prompt))
    assert body["choices"][0]["finish_reason"] == "length"
    # vllm_xargs alone, above the hit rate (a cached prompt still recomputes >= 1 token).
    status, body = post_json(url, "/v1/completions", completion(prompt, vllm_xargs={"cache_hit_threshold": 1.0}))
    assert_rejected_body(body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"cache_hit_threshold": 1.5}, "cache_hit_threshold"),
        ({"cache_hit_threshold": -0.1}, "cache_hit_threshold"),
        ({"cache_hit_threshold": "0.5"}, "cache_hit_threshold"),
        ({"cache_hit_threshold": True}, "cache_hit_threshold"),
        ({"vllm_xargs": {"cache_hit_threshold": 1.5}}, "vllm_xargs.cache_hit_threshold"),
        ({"vllm_xargs": {"cache_hit_threshold": "0.5"}}, "vllm_xargs.cache_hit_threshold"),
        ({"cache_hit_threshold": 0.5, "vllm_xargs": {"cache_hit_threshold": 7}}, "vllm_xargs.cache_hit_threshold"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_threshold_is_400_in_vllm_error_shape(
    threshold_engine: EngineProcess, path: str, fields: dict[str, Any], param: str, stream: bool
) -> None:
    body = completion("hello", **fields) if path == "/v1/completions" else chat("hello", **fields)
    body["stream"] = stream
    status, answer = post_json(threshold_engine.base_url, path, body)
    assert status == 400
    assert set(answer) == {"error"}
    error = answer["error"]
    assert error["code"] == 400
    assert error["type"] == "BadRequestError"
    assert error["param"] == param
    assert f"(parameter={param}" in error["message"]


def test_streaming_rejection_completions_has_finish_and_usage_chunks(threshold_engine: EngineProcess) -> None:
    status, events = post_sse(
        threshold_engine.base_url,
        "/v1/completions",
        completion(cold_prompt(), stream=True, stream_options={"include_usage": True}, cache_hit_threshold=0.5),
    )
    assert status == 200
    assert len(events) == 3, events
    finish, usage, done = events
    choice = finish["choices"][0]
    assert choice["finish_reason"] == "cache_threshold"
    assert choice["text"] == ""
    assert choice["token_ids"] == []
    assert choice["prompt_token_ids"], "the first chunk of a choice carries prompt_token_ids"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 0
    assert usage["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert done == "[DONE]"
    assert finish["id"] == usage["id"]


def test_streaming_rejection_without_usage(threshold_engine: EngineProcess) -> None:
    status, events = post_sse(
        threshold_engine.base_url,
        "/v1/completions",
        completion(cold_prompt(), stream=True, return_token_ids=False, cache_hit_threshold=0.5),
    )
    assert status == 200
    assert len(events) == 2, events
    finish, done = events
    assert finish["choices"][0]["finish_reason"] == "cache_threshold"
    assert finish["choices"][0]["token_ids"] is None
    assert "system_fingerprint" in finish  # the last chunk carries it when there is no usage
    assert done == "[DONE]"


def test_streaming_rejection_chat_role_chunk_then_finish(threshold_engine: EngineProcess) -> None:
    status, events = post_sse(
        threshold_engine.base_url,
        "/v1/chat/completions",
        chat(cold_prompt(), stream=True, stream_options={"include_usage": True}, cache_hit_threshold=0.5),
    )
    assert status == 200
    assert len(events) == 4, events
    role, finish, usage, done = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["choices"][0]["finish_reason"] is None
    assert role["prompt_token_ids"]
    choice = finish["choices"][0]
    assert choice["finish_reason"] == "cache_threshold"
    assert choice["delta"] == {"content": ""}
    assert choice["token_ids"] == []
    assert usage["usage"]["completion_tokens"] == 0
    assert done == "[DONE]"


def test_chat_non_streaming_rejection_and_acceptance(threshold_engine: EngineProcess) -> None:
    url = threshold_engine.base_url
    content = cold_prompt()
    status, body = post_json(url, "/v1/chat/completions", chat(content, cache_hit_threshold=0.5))
    assert status == 200
    assert_rejected_body(body, chat_api=True)
    assert body["choices"][0]["token_ids"] == []
    status, body = post_json(url, "/v1/chat/completions", chat(content, cache_hit_threshold=0))
    assert body["choices"][0]["finish_reason"] == "length"
    status, body = post_json(url, "/v1/chat/completions", chat(content, cache_hit_threshold=0.5))
    assert body["choices"][0]["finish_reason"] == "length"


def test_prefill_leg_is_never_rejected(threshold_engine: EngineProcess) -> None:
    """A NIXL prefill leg (do_remote_decode) on a cold prompt, with a threshold above any
    possible hit rate and the engine-wide 0.5: served, and returns kv_transfer_params."""
    body = completion(
        cold_prompt(),
        max_tokens=1,
        cache_hit_threshold=1.0,
        kv_transfer_params=PREFILL_REQUEST_PARAMS,
    )
    status, answer = post_json(threshold_engine.base_url, "/v1/completions", body)
    assert status == 200
    assert answer["choices"][0]["finish_reason"] == "length", answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["remote_block_ids"]
    assert params["remote_block_ids"][0]
    assert params["remote_num_tokens"] == answer["usage"]["prompt_tokens"]


def test_rejections_are_counted_in_metrics(threshold_engine: EngineProcess) -> None:
    url = threshold_engine.base_url
    before = scrape_metrics(url)
    _status, body = post_json(url, "/v1/completions", completion(cold_prompt(), cache_hit_threshold=0.5))
    assert_rejected_body(body)
    # The engine core pushes stats to the API server about once a second.
    deadline = time.monotonic() + 15
    while True:
        after = scrape_metrics(url)
        # No request has finished that way before the first rejection: no sample yet reads 0.
        success = after.sample_or_zero(
            "vllm:request_success_total", finished_reason="cache_threshold"
        ) - before.sample_or_zero("vllm:request_success_total", finished_reason="cache_threshold")
        if success >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert success >= 1
    arrival = after.value("cachehit_threshold_rejections_total", stage="arrival") - before.sample_or_zero(
        "cachehit_threshold_rejections_total", stage="arrival"
    )
    assert arrival == 1  # this engine checks at arrival; a cold prompt is rejected there
