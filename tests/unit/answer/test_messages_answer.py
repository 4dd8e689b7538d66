"""Chat answers rewritten as vLLM 0.32's `/v1/messages` writes them (the converter's steps
over dicts: `message_stream_converter`, `messages_full_converter`)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.answer.messages_answer import MessagesStream, stop_reason_of, usage_of, whole_message
from router.errors import RouterError


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **kw: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, **kw}]
    return {"id": "chatcmpl-1", "model": "m", "choices": choices, "usage": {"prompt_tokens": 7, "completion_tokens": 0}}


def _events(raw: bytes) -> list[tuple[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            out.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return out


def test_a_text_stream() -> None:
    s = MessagesStream()
    raw = s.encode(
        [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hel"}), _chunk({"content": "lo"})]
    )
    raw += s.encode([_chunk({"content": ""}, "length"), _chunk(None)])
    events = _events(raw + s.trailer())
    assert [n for n, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1] == {
        "type": "message_start",
        "message": {
            "id": "chatcmpl-1",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "m",
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 7, "output_tokens": 0},
        },
    }
    assert events[1][1] == {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}
    assert events[2][1] == {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hel"}, "index": 0}
    assert events[4][1] == {"type": "content_block_stop", "index": 0}
    assert events[5][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[6][1] == {"type": "message_stop"}


def test_a_rejected_answer_has_no_stop_reason() -> None:
    s = MessagesStream()
    raw = s.encode(
        [_chunk({"role": "assistant", "content": ""}), _chunk({"content": ""}, "cache_threshold"), _chunk(None)]
    )
    events = _events(raw + s.trailer())
    assert [n for n, _ in events] == ["message_start", "message_delta", "message_stop"]
    assert events[1][1]["delta"] == {"stop_reason": None, "stop_sequence": None}


def test_thinking_then_text_then_a_tool_call() -> None:
    s = MessagesStream()
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"a":'}}
    more = {"index": 0, "function": {"arguments": " 1}"}}
    raw = s.encode(
        [
            _chunk({"role": "assistant", "content": ""}),
            _chunk({"reasoning": "think"}),
            _chunk({"content": "ok"}),
            _chunk({"tool_calls": [call]}),
            _chunk({"tool_calls": [more]}),
            _chunk({}, "tool_calls"),
            _chunk(None),
        ]
    )
    events = _events(raw + s.trailer())
    names = [(n, d.get("index")) for n, d in events]
    assert names == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),  # the thinking block's signature
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert events[3][1]["delta"]["type"] == "signature_delta"
    assert events[8][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get", "input": {}}
    assert events[12][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_an_error_event() -> None:
    err = RouterError(502, "gone", type="BadGatewayError")
    assert _events(MessagesStream().error(err)) == [
        ("error", {"type": "error", "error": {"type": "BadGatewayError", "message": "gone"}})
    ]


def test_whole_message() -> None:
    choice: dict[str, Any] = {
        "message": {"role": "assistant", "content": "hi"},
        "finish_reason": "stop",
        "stop_reason": None,
    }
    chat: dict[str, Any] = {
        "id": "chatcmpl-1",
        "model": "m",
        "choices": [choice],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 2}},
    }
    assert whole_message(chat) == {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "hi"}],
        "model": "m",
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 3, "output_tokens": 1, "cache_read_input_tokens": 2},
    }
    choice.update(message={"role": "assistant", "content": ""}, finish_reason="cache_threshold")
    rejected = whole_message(chat)
    assert rejected["content"] == [{"type": "text", "text": ""}]
    assert "stop_reason" not in rejected  # None, dropped as vLLM's exclude_none drops it


@pytest.mark.parametrize(
    ("finish", "stop", "tool_used", "expected"),
    [
        ("length", None, False, ("max_tokens", None)),
        ("stop", None, False, ("end_turn", None)),
        ("stop", "END", False, ("stop_sequence", "END")),
        ("stop", 2, False, ("end_turn", None)),
        ("tool_calls", None, False, ("tool_use", None)),
        ("stop", None, True, ("tool_use", None)),
        ("cache_threshold", None, False, (None, None)),
        ("abort", None, False, (None, None)),
    ],
)
def test_stop_reasons(finish: str, stop: Any, tool_used: bool, expected: tuple[str | None, str | None]) -> None:
    assert stop_reason_of(finish, stop, tool_used=tool_used, tool_complete=False) == expected


def test_usage_without_details() -> None:
    assert usage_of(None) == {"input_tokens": 0, "output_tokens": 0}
    assert usage_of({"prompt_tokens": 4, "completion_tokens": None}) == {"input_tokens": 4, "output_tokens": 0}
