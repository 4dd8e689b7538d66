"""A non-streaming client's answer (router/answer/assembly.py): the legs' chunks accumulated
into the body vLLM would have returned, reasoning and tool-call deltas merged."""

from __future__ import annotations

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS
from router.answer.shaper import ResponseShaper
from support.shaping import PROMPT, chat_chunk, client_view, make_spec, run_legs, steps_for
from support.vllm_serving import (
    Gen,
    Step,
    chat_full,
    chat_stream,
    completion_full,
    completion_stream,
)


def test_non_streaming_one_leg_equals_vllm_body() -> None:
    for endpoint, full, stream in (
        (ENDPOINT_COMPLETIONS, completion_full, completion_stream),
        (ENDPOINT_CHAT, chat_full, chat_stream),
    ):
        for rti in (False, True):
            spec = make_spec(endpoint, stream=False, return_token_ids=rti, logprobs=2)
            g = Gen(
                PROMPT, steps_for(4, logprobs=True, per_step=2), cached_tokens=3, logprobs=2, system_fingerprint="fp"
            )
            sh, _ = run_legs(spec, [(False, stream(g))])
            assert sh.accumulate_response() == full(client_view(spec, g))


def test_non_streaming_chat_merges_reasoning_and_tool_call_deltas() -> None:
    spec = make_spec(ENDPOINT_CHAT, stream=False)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    role = chat_stream(Gen(PROMPT, []))[0]
    chunks = [
        role,
        chat_chunk({"reasoning": "think "}, ids=[1]),
        chat_chunk({"reasoning": "more"}, ids=[2]),
        chat_chunk(
            {
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-1",
                        "type": "function",
                        "index": 0,
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            },
            ids=[3],
        ),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, ids=[4]),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, ids=[5]),
        chat_chunk({}, finish="tool_calls", ids=[6]),
    ]
    for c in chunks:
        assert sh.shape(c) == []  # nothing is built for a non-streaming client
    assert not sh.emitted
    assert sh.answer.first_token_seen
    msg = sh.accumulate_response()["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    assert msg["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
        "reasoning": "think more",
    }
    assert list(sh.answer.generated_token_ids) == [1, 2, 3, 4, 5, 6]


def test_reasoning_then_content() -> None:
    spec = make_spec(ENDPOINT_CHAT, stream=False)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for c in [
        chat_stream(Gen(PROMPT, []))[0],
        chat_chunk({"reasoning": "r"}, ids=[1]),
        chat_chunk({"content": "answer"}, ids=[2]),
        chat_chunk({"content": ""}, finish="stop", ids=[3]),
    ]:
        sh.shape(c)
    m = sh.accumulate_response()["choices"][0]["message"]
    assert (m["content"], m["reasoning"]) == ("answer", "r")
    assert "tool_calls" not in m


def test_zero_token_answer_has_empty_content() -> None:
    spec = make_spec(ENDPOINT_CHAT, stream=False)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for c in chat_stream(Gen(PROMPT, [Step("", [], "stop")])):
        sh.shape(c)
    r = sh.accumulate_response()
    assert r["choices"][0]["message"]["content"] == ""
    assert r["usage"]["completion_tokens"] == 0
