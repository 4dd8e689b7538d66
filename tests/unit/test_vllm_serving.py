"""The reference the shaper tests compare with (support/vllm_serving.py), rebuilt with vLLM
0.32's own response classes and dumped the way its serving layer dumps them (slow:
importing vLLM takes seconds)."""

from __future__ import annotations

import orjson
import pytest

from router.admission.spec import ENDPOINT_CHAT
from router.answer.shaper import ResponseShaper
from support.requirements import require_module
from support.shaping import PROMPT, chat_chunk, make_spec, steps_for
from support.vllm_serving import (
    Gen,
    _chat_logprobs,
    _completion_logprobs,
    chat_full,
    chat_stream,
    completion_full,
    completion_stream,
)


@pytest.mark.slow
def test_vllm_serving_transcription_matches_vllm_models() -> None:
    cp = require_module("vllm.entrypoints.openai.completion.protocol")
    ch = require_module("vllm.entrypoints.openai.chat_completion.protocol")
    base = require_module("vllm.entrypoints.generate.base.protocol")
    eng = require_module("vllm.entrypoints.serve.engine.protocol")

    g = Gen(PROMPT, steps_for(2, finish="stop", logprobs=True), cached_tokens=1, logprobs=2, system_fingerprint="fp")
    steps = g.steps
    ids = [t for s in steps for t in s.token_ids]

    # completions, streaming chunks: model_dump_json(exclude_unset=True)
    lp0, _ = _completion_logprobs([steps[0]], 0)
    chunk = cp.CompletionStreamResponse(
        id=g.request_id,
        object="text_completion",
        created=g.created,
        model=g.model,
        choices=[
            cp.CompletionResponseStreamChoice(
                index=0,
                text=steps[0].text,
                logprobs=cp.CompletionLogProbs(**lp0),
                finish_reason=None,
                stop_reason=None,
                prompt_token_ids=PROMPT,
                token_ids=steps[0].token_ids,
            )
        ],
    )
    assert orjson.loads(chunk.model_dump_json(exclude_unset=True)) == completion_stream(g)[0]
    usage = eng.UsageInfo(prompt_tokens=4, completion_tokens=2, total_tokens=6)
    usage.prompt_tokens_details = eng.PromptTokenUsageInfo(cached_tokens=1)
    uchunk = cp.CompletionStreamResponse(
        id=g.request_id, created=g.created, model=g.model, choices=[], usage=usage, system_fingerprint="fp"
    )
    assert orjson.loads(uchunk.model_dump_json(exclude_unset=False, exclude_none=True)) == completion_stream(g)[-1]

    # completions, non-streaming: model_dump()
    lp_all, _ = _completion_logprobs(steps, 0)
    full = cp.CompletionResponse(
        id=g.request_id,
        created=g.created,
        model=g.model,
        usage=usage,
        system_fingerprint="fp",
        choices=[
            cp.CompletionResponseChoice(
                index=0,
                text="t0t1",
                logprobs=cp.CompletionLogProbs(**lp_all),
                finish_reason="stop",
                stop_reason=None,
                prompt_logprobs=None,
                prompt_token_ids=PROMPT,
                token_ids=ids,
                routed_experts=None,
            )
        ],
    )
    assert full.model_dump() == completion_full(g)

    # chat, streaming: role chunk, token chunk, finish chunk, usage chunk
    head = dict(id=g.request_id, object="chat.completion.chunk", created=g.created, model=g.model)
    role = ch.ChatCompletionStreamResponse(
        **head,
        choices=[
            ch.ChatCompletionResponseStreamChoice(
                index=0, delta=base.DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None
            )
        ],
        prompt_token_ids=PROMPT,
        prompt_text=None,
    )
    cs = chat_stream(g)
    assert orjson.loads(role.model_dump_json(exclude_unset=True)) == cs[0]
    clp = _chat_logprobs
    for k, s in enumerate(steps):
        kw = dict(
            index=0,
            delta=base.DeltaMessage(content=s.text),
            logprobs=ch.ChatCompletionLogProbs(**clp([s], 2)),
            finish_reason=s.finish_reason,
        )
        if s.finish_reason is not None:
            kw["stop_reason"] = s.stop_reason
        c = ch.ChatCompletionStreamResponse(
            **head, choices=[ch.ChatCompletionResponseStreamChoice(**kw, token_ids=s.token_ids)]
        )
        assert orjson.loads(c.model_dump_json(exclude_unset=True)) == cs[1 + k]
    cu = eng.UsageInfo(prompt_tokens=4, completion_tokens=2, total_tokens=6, completion_tokens_details=None)
    cu.prompt_tokens_details = eng.PromptTokenUsageInfo(cached_tokens=1)
    uc = ch.ChatCompletionStreamResponse(**head, choices=[], usage=cu, system_fingerprint="fp")
    assert orjson.loads(uc.model_dump_json(exclude_unset=True, exclude_none=True)) == cs[-1]

    # chat, non-streaming
    msg = ch.ChatMessage(role="assistant", reasoning=None, content="t0t1")
    cfull = ch.ChatCompletionResponse(
        id=g.request_id,
        created=g.created,
        model=g.model,
        usage=cu,
        system_fingerprint="fp",
        choices=[
            ch.ChatCompletionResponseChoice(
                index=0,
                message=msg,
                logprobs=ch.ChatCompletionLogProbs(**clp(steps, 2)),
                finish_reason="stop",
                stop_reason=None,
                token_ids=ids,
            )
        ],
        prompt_logprobs=None,
        prompt_token_ids=PROMPT,
        prompt_text=None,
    )
    assert cfull.model_dump() == chat_full(g)

    # chat continuous usage as the shaper writes it
    c = ch.ChatCompletionStreamResponse(**head, choices=[])
    c.usage = eng.UsageInfo(prompt_tokens=4, completion_tokens=1, total_tokens=5, completion_tokens_details=None)
    spec = make_spec(ENDPOINT_CHAT, include_usage=True, continuous=True)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    sh.shape(chat_stream(Gen(PROMPT, steps_for(2)))[0])
    (first,) = sh.shape(chat_stream(Gen(PROMPT, steps_for(2)))[1])
    assert first["usage"] == orjson.loads(c.model_dump_json(exclude_unset=True))["usage"]

    # a chat answer with reasoning and a tool call, non-streaming message
    m = ch.ChatMessage(
        role="assistant",
        reasoning="r",
        content=None,
        tool_calls=[base.ToolCall(id="call1", function=base.FunctionCall(name="f", arguments="{}"))],
    )
    sh = ResponseShaper(make_spec(ENDPOINT_CHAT, stream=False))
    sh.begin_leg(is_resume=False)
    for c in [
        chat_stream(Gen(PROMPT, []))[0],
        chat_chunk({"reasoning": "r"}, ids=[1]),
        chat_chunk(
            {
                "tool_calls": [
                    {"id": "call1", "type": "function", "index": 0, "function": {"name": "f", "arguments": "{"}}
                ]
            },
            ids=[2],
        ),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}, finish="tool_calls", ids=[3]),
    ]:
        sh.shape(c)
    assert sh.accumulate_response()["choices"][0]["message"] == m.model_dump()
