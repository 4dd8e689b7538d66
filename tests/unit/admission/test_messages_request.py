"""A Messages API body as the chat completion vLLM 0.32 builds of it
(`AnthropicServingMessages.to_chat_completion_request`), or NotConvertible."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.admission.messages_request import NotConvertible, chat_body_of, check_messages_body
from router.errors import RouterError


def _body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_the_plain_request_and_its_sampling_fields() -> None:
    chat = chat_body_of(
        _body(system="be brief", stop_sequences=["x"], temperature=0.0, top_p=0.9, top_k=3, metadata={"user_id": "u"})
    )
    assert chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "max_completion_tokens": 5,
        "stop": ["x"],
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 3,
    }


def test_a_stream_asks_for_usage_on_every_chunk() -> None:
    chat = chat_body_of(_body(stream=True))
    assert chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_system_blocks_lose_the_billing_header_and_are_joined() -> None:
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: abc"},
        {"type": "text", "text": "one "},
        {"type": "text", "text": "two"},
    ]
    assert chat_body_of(_body(system=system))["messages"][0] == {"role": "system", "content": "one two"}


def test_content_blocks_tool_use_and_tool_results() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "let me check"},
                {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]}],
        },
    ]
    chat = chat_body_of(_body(messages=messages))
    assert chat["messages"] == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "reasoning": "hmm",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
            "content": "let me check",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
    ]


def test_tools_and_tool_choice() -> None:
    tools = [{"name": "get", "description": "d", "input_schema": {"type": "object"}}]
    chat = chat_body_of(_body(tools=tools, tool_choice={"type": "any"}))
    assert chat["tool_choice"] == "required"
    assert chat["parallel_tool_calls"] is True
    assert chat["tools"][0]["function"]["name"] == "get"
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}
    assert chat_body_of(_body(tools=tools))["tool_choice"] == "auto"
    named = chat_body_of(_body(tools=tools, tool_choice={"type": "tool", "name": "get"}))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get"}}


def test_router_fields_are_dropped() -> None:
    chat = chat_body_of(
        _body(
            kv_transfer_params={"remote_host": "h"},
            cache_hit_threshold=1.0,
            vllm_xargs={"cache_hit_threshold": 1, "a": 1},
        )
    )
    assert "kv_transfer_params" not in chat
    assert "cache_hit_threshold" not in chat
    assert chat["vllm_xargs"] == {"a": 1}


@pytest.mark.parametrize(
    "extra",
    [
        {"messages": [{"role": "system", "content": "inline"}]},  # merged or not: the template decides
        {"thinking": {"type": "disabled"}},  # vLLM probes the template for the effort
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        {"some_future_field": 1},
    ],
)
def test_what_only_the_engine_converts_exactly(extra: dict[str, Any]) -> None:
    with pytest.raises(NotConvertible):
        chat_body_of(_body(**extra))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"messages": []}, "model"),
        ({"model": "m", "max_tokens": 1}, "messages"),
        ({"model": "m", "messages": []}, "max_tokens"),
    ],
)
def test_what_the_router_reads_itself_is_checked(body: Any, param: str | None) -> None:
    with pytest.raises(RouterError) as e:
        check_messages_body(body)
    assert e.value.status == 400
    assert e.value.param == param
