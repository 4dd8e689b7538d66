"""The vLLM wire format as the router speaks it (router/engine/wire.py): the usage parser,
token counting, the verdict of a chunk, and every leg body (probe/direct, NIXL prefill and
decode, resume)."""

from __future__ import annotations

import pytest

from router.engine.wire import (
    CACHE_THRESHOLD,
    NO_USAGE,
    PREFILL_REQUEST_PARAMS,
    THRESHOLD_KEY,
    Usage,
    decode_leg_body,
    generated_tokens,
    is_rejection_chunk,
    message_usage,
    one_token_probe,
    parse_usage,
    prefill_leg_body,
    resume_leg_body,
    streamed_leg_body,
    unary_leg_body,
)
from support.shaping import PROMPT, steps_for
from support.vllm_serving import (
    Gen,
    Step,
    chat_stream,
    completion_stream,
)
from support.wire_captures import stream_chunks


def test_is_rejection_chunk() -> None:
    g = Gen(PROMPT, steps_for(2))
    role, first = chat_stream(g)[:2]
    usage = chat_stream(g)[-1]
    assert is_rejection_chunk(role) is None
    assert is_rejection_chunk(usage) is None
    assert is_rejection_chunk({}) is None
    assert is_rejection_chunk(first) is False
    assert is_rejection_chunk(completion_stream(g)[0]) is False
    rej = Gen(PROMPT, [Step("", [], CACHE_THRESHOLD)])
    assert is_rejection_chunk(chat_stream(rej)[1]) is True
    assert is_rejection_chunk(completion_stream(rej)[0]) is True
    # Another finish with nothing generated is an answer (e.g. max_tokens reached at once).
    assert is_rejection_chunk(completion_stream(Gen(PROMPT, [Step("", [], "stop")]))[0]) is False
    # cache_threshold with tokens in the same chunk: accepted (the leg produced output).
    assert is_rejection_chunk(completion_stream(Gen(PROMPT, [Step("a", [5], CACHE_THRESHOLD)]))[0]) is False
    assert (
        is_rejection_chunk(
            {"choices": [{"index": 0, "delta": {"reasoning": "hm"}, "finish_reason": None, "token_ids": None}]}
        )
        is False
    )
    # The chunk vLLM sends for chat `echo` right after the role chunk, before any decision
    # (no token_ids key, like the role chunk): undecided, though it has text.
    echo = {
        "choices": [{"index": 0, "delta": {"content": "the last message"}, "logprobs": None, "finish_reason": None}]
    }
    assert is_rejection_chunk(echo) is None
    # A byte-level token whose text comes later: token ids decide.
    assert (
        is_rejection_chunk(
            {
                "choices": [
                    {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None, "token_ids": [7]}
                ]
            }
        )
        is False
    )
    assert is_rejection_chunk({"choices": ["junk"]}) is None


def test_real_capture_verdicts() -> None:
    chat = stream_chunks("chat_stream_usage_token_ids")
    assert [is_rejection_chunk(c) for c in chat] == [None, False, False, False, False, None]
    cmpl = stream_chunks("disagg_decode_leg_stream")
    assert is_rejection_chunk(cmpl[0]) is False
    assert is_rejection_chunk(cmpl[-1]) is None


def test_usage_reads_every_field_the_router_uses() -> None:
    u = message_usage(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 526,
                "completion_tokens": 7,
                "total_tokens": 533,
                "prompt_tokens_details": {"cached_tokens": 512},
                "completion_tokens_details": {"reasoning_tokens": 3},
            },
        }
    )
    assert u == Usage(
        prompt_tokens=526,
        completion_tokens=7,
        cached_tokens=512,
        prompt_tokens_details={"cached_tokens": 512},
        reasoning_tokens=3,
    )


@pytest.mark.parametrize("usage", [None, "x", [1], 5])
def test_no_usage_object_reads_as_nothing(usage: object) -> None:
    assert parse_usage(usage) is NO_USAGE
    assert message_usage({"usage": usage}) is NO_USAGE
    assert message_usage({}) is NO_USAGE


def test_usage_fields_that_are_not_counts_read_as_absent() -> None:
    u = parse_usage(
        {
            "prompt_tokens": "526",
            "completion_tokens": None,
            "prompt_tokens_details": [512],
            "completion_tokens_details": {"reasoning_tokens": "3"},
        }
    )
    assert u == NO_USAGE
    # A hit count must be a non-negative integer (a bool is not one).
    for cached in (-1, True, 1.5, "512"):
        assert parse_usage({"prompt_tokens_details": {"cached_tokens": cached}}).cached_tokens is None
    assert parse_usage({"prompt_tokens_details": {"cached_tokens": 0}}).cached_tokens == 0


def test_generated_tokens_counts_ids_else_one_per_text_choice() -> None:
    assert generated_tokens({"choices": [{"token_ids": [1, 2, 3], "text": "abc"}]}) == 3
    assert generated_tokens({"choices": [{"token_ids": None, "text": "abc"}]}) == 1
    assert generated_tokens({"choices": [{"delta": {"content": "a"}}]}) == 1
    assert generated_tokens({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == 0
    assert generated_tokens({"choices": [], "usage": {"prompt_tokens": 3}}) == 0


def test_one_token_probe_races_the_first_prompt_for_one_token() -> None:
    body = {
        "model": "m",
        "prompt": ["first", "second"],
        "n": 4,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 50,
        "min_tokens": 5,
        "temperature": 0.3,
    }
    out = one_token_probe(body)
    assert out == {"model": "m", "prompt": "first", "max_tokens": 1, "temperature": 0.3}
    assert one_token_probe({"prompt": [[1, 2], [3]]})["prompt"] == [1, 2]
    assert one_token_probe({"prompt": [1, 2, 3]})["prompt"] == [1, 2, 3]  # one prompt of token ids
    assert body["prompt"] == ["first", "second"]  # the client's body is not touched
    leg = streamed_leg_body(out, 0.4)
    assert leg[THRESHOLD_KEY] == 0.4
    assert leg["stream"] is True


def test_unary_leg_sets_threshold_zero_explicitly() -> None:
    body = {"model": "m", "prompt": "x", "stream": True}
    assert unary_leg_body(body) == {"model": "m", "prompt": "x", "stream": False, THRESHOLD_KEY: 0.0}
    assert body == {"model": "m", "prompt": "x", "stream": True}


def test_streamed_leg_sets_threshold_both_ways_and_keeps_client_xargs() -> None:
    body = {"model": "m", "prompt": "hi", "stream": False, "vllm_xargs": {"foo": 1}}
    out = streamed_leg_body(body, 0.5)
    assert out["cache_hit_threshold"] == 0.5
    assert out["vllm_xargs"] == {"foo": 1, "cache_hit_threshold": 0.5}
    assert out["stream"] is True
    assert out["stream_options"] == {"include_usage": True}
    assert out["return_token_ids"] is True
    assert body == {"model": "m", "prompt": "hi", "stream": False, "vllm_xargs": {"foo": 1}}


def test_prefill_leg_matches_the_nixl_protocol() -> None:
    body = {
        "model": "m",
        "messages": [],
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
        "temperature": 0.2,
    }
    out = prefill_leg_body(body)
    assert out["max_tokens"] == 1
    assert out["max_completion_tokens"] == 1
    assert out["stream"] is False
    assert "stream_options" not in out
    assert "min_tokens" not in out
    assert out["kv_transfer_params"] == PREFILL_REQUEST_PARAMS
    assert out["temperature"] == 0.2
    assert "max_completion_tokens" not in prefill_leg_body({"prompt": "x"})


def test_decode_leg_carries_the_producers_params_verbatim() -> None:
    kv = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_host": "h", "remote_port": 5601}
    out = decode_leg_body({"prompt": "x"}, kv, 0.1)
    assert out["kv_transfer_params"] is kv
    assert out["cache_hit_threshold"] == 0.1


def test_completion_resume_body() -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 10, "min_tokens": 4, "echo": False, "temperature": 0}
    out = resume_leg_body(body, "completions", [1, 2, 3], [7, 8, 9], 10)
    assert out["prompt"] == [1, 2, 3, 7, 8, 9]
    assert out["max_tokens"] == 7
    assert out["min_tokens"] == 1
    assert "echo" not in out
    assert out["temperature"] == 0
    assert out["model"] == "m"


def test_chat_resume_body_keeps_only_sampling_fields() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_completion_tokens": 5,
        "temperature": 0.5,
        "logprobs": True,
        "top_logprobs": 2,
        "tools": [],
        "stop": ["\n"],
    }
    out = resume_leg_body(body, "chat", [1], [2, 3], 5)
    assert out == {
        "model": "m",
        "temperature": 0.5,
        "stop": ["\n"],
        "logprobs": 2,
        "prompt": [1, 2, 3],
        "max_tokens": 3,
    }
    assert "max_tokens" not in resume_leg_body({"prompt": "x"}, "completions", [1], [2], None)


def test_unary_leg_asks_for_token_ids_when_the_client_did() -> None:
    body = {"model": "m", "prompt": "x"}
    leg = unary_leg_body(body, return_token_ids=True)
    assert leg == {"model": "m", "prompt": "x", "stream": False, THRESHOLD_KEY: 0.0, "return_token_ids": True}
    assert "return_token_ids" not in body
