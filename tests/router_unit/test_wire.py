"""router/engine/wire.py: the usage parser, token counting and the leg bodies not covered elsewhere
(the streamed, prefill, decode and resume bodies: tests/router_unit/test_leg_bodies.py; the
verdict: test_shaping.py)."""

from __future__ import annotations

import pytest

from router.engine.wire import (
    NO_USAGE,
    THRESHOLD_KEY,
    Usage,
    generated_tokens,
    message_usage,
    one_token_probe,
    parse_usage,
    streamed_leg_body,
    unary_leg_body,
)


def test_usage_reads_every_field_the_router_uses():
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
def test_no_usage_object_reads_as_nothing(usage):
    assert parse_usage(usage) is NO_USAGE
    assert message_usage({"usage": usage}) is NO_USAGE
    assert message_usage({}) is NO_USAGE


def test_usage_fields_that_are_not_counts_read_as_absent():
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


def test_generated_tokens_counts_ids_else_one_per_text_choice():
    assert generated_tokens({"choices": [{"token_ids": [1, 2, 3], "text": "abc"}]}) == 3
    assert generated_tokens({"choices": [{"token_ids": None, "text": "abc"}]}) == 1
    assert generated_tokens({"choices": [{"delta": {"content": "a"}}]}) == 1
    assert generated_tokens({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == 0
    assert generated_tokens({"choices": [], "usage": {"prompt_tokens": 3}}) == 0


def test_one_token_probe_races_the_first_prompt_for_one_token():
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


def test_unary_leg_sets_threshold_zero_explicitly():
    body = {"model": "m", "prompt": "x", "stream": True}
    assert unary_leg_body(body) == {"model": "m", "prompt": "x", "stream": False, THRESHOLD_KEY: 0.0}
    assert body == {"model": "m", "prompt": "x", "stream": True}


def test_unary_leg_asks_for_token_ids_when_the_client_did():
    body = {"model": "m", "prompt": "x"}
    leg = unary_leg_body(body, return_token_ids=True)
    assert leg == {"model": "m", "prompt": "x", "stream": False, THRESHOLD_KEY: 0.0, "return_token_ids": True}
    assert "return_token_ids" not in body
