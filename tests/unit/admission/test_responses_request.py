"""The one-token chat probe that stands for a Responses API body's prompt."""

from __future__ import annotations

from typing import Any

import pytest

from router.admission.responses_request import probe_chat_body


def test_instructions_and_a_string_input() -> None:
    assert probe_chat_body({"model": "m", "instructions": "sys", "input": "hi"}) == {
        "model": "m",
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        "max_tokens": 1,
    }


def test_message_items_with_text_parts() -> None:
    body = {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
            {"role": "user", "content": "d"},
        ]
    }
    assert probe_chat_body(body) == {
        "messages": [
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "c"},
            {"role": "user", "content": "d"},
        ],
        "max_tokens": 1,
    }


@pytest.mark.parametrize(
    "body",
    [
        {"input": "hi", "previous_response_id": "resp_1"},
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
        {"input": [{"role": "developer", "content": "x"}]},
        {"input": 3},
        {"instructions": ["x"], "input": "hi"},
    ],
)
def test_a_prompt_the_probe_cannot_reproduce_is_not_raced(body: dict[str, Any]) -> None:
    assert probe_chat_body(body) is None
