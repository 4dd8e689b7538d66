"""JSON bodies and SSE chunks in the exact shapes vLLM 0.32's OpenAI server writes.

Shapes follow vllm/entrypoints/openai/{completion,chat_completion}/{serving,protocol}.py:
- non-streaming bodies are a full pydantic dump: every field, `null` when unset;
- stream chunks are dumped with `exclude_unset`: a choice carries exactly the fields the
  serving code passes (so `prompt_token_ids` is a key, `null` after the first chunk, in
  completion chunks; chat carries `prompt_token_ids` at the top level of its first chunk);
- the final usage chunk is dumped with `exclude_none` and has `choices: []`;
- `system_fingerprint` is on non-streaming bodies and the usage chunk, and on the finishing
  chunk when no usage chunk follows.
"""

from __future__ import annotations

from typing import Any

import orjson

from . import tokenizer as tok
from .protocol import ParsedRequest
from .request import SimRequest


class ResponseContext:
    """Per-request constants of the answer: id, created, model, fingerprint."""

    __slots__ = ("chat", "created", "fingerprint", "model", "parsed", "request_id")

    def __init__(self, request_id: str, created: int, model: str, fingerprint: str, parsed: ParsedRequest) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.fingerprint = fingerprint
        self.parsed = parsed
        self.chat = parsed.chat


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(req: SimRequest, details: bool, full: bool, chat: bool = False) -> dict[str, Any]:
    """`full`: every field, as a non-streaming body serializes; otherwise only the fields
    vLLM's stream carries: a chat stream's usage has cached_tokens and
    created_cache_tokens (checked against a real engine by
    tests/real_engine/test_router_real.py), a completion stream's only cached_tokens."""
    p = len(req.prompt_ids)
    c = len(req.output_ids)
    u: dict[str, Any] = {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}
    ptd: dict[str, int | None] | None = None
    if details:
        ptd = {"cached_tokens": max(req.num_cached_tokens, 0)}
        if full:
            ptd.update(created_cache_tokens=None, multimodal_tokens=None)
        elif chat:
            ptd["created_cache_tokens"] = None
    if full:
        u["prompt_tokens_details"] = ptd
        u["completion_tokens_details"] = None
    elif ptd is not None:
        u["prompt_tokens_details"] = ptd
    return u


def _completion_logprobs(lps: list[list[tuple[int, float]]], k: int, offset: int) -> dict[str, Any]:
    out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for entries in lps:
        token_id, lp = entries[0]
        text = tok.token_text(token_id)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(lp)
        out["tokens"].append(text)
        top: dict[str, float] = {}
        for tid, tlp in entries:
            top.setdefault(tok.token_text(tid), tlp)
        out["top_logprobs"].append(top)
    return out


def _chat_logprobs(lps: list[list[tuple[int, float]]], k: int) -> dict[str, Any]:
    content = []
    for entries in lps:
        token_id, lp = entries[0]
        text = tok.token_text(token_id)
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": tok.token_text(t), "logprob": l, "bytes": list(tok.token_text(t).encode())}
                    for t, l in entries[:k]
                ],
            }
        )
    return {"content": content}


class CompletionStreamState:
    """Running offsets a stream needs (completion logprobs' text_offset)."""

    __slots__ = ("first", "text_offset")

    def __init__(self) -> None:
        self.text_offset = 0
        self.first = True


def stream_chunk(
    ctx: ResponseContext,
    req: SimRequest,
    state: CompletionStreamState,
    ids: list[int],
    text: str,
    lps: list[list[tuple[int, float]]] | None,
    finish_reason: str | None,
    stop_reason: Any,
    index: int = 0,
    echo: str | None = None,
) -> bytes:
    """`echo`: the prompt's text, put before the first chunk's text, whose choice then
    carries the prompt ids even without return_token_ids (vLLM's completions echo)."""
    p = ctx.parsed
    want_ids = p.return_token_ids
    logprobs = None
    if p.want_logprobs and lps is not None:
        logprobs = (
            _chat_logprobs(lps, p.sampling.logprobs or 0)
            if ctx.chat
            else _completion_logprobs(lps, p.sampling.logprobs or 0, state.text_offset)
        )
        for t in ids:  # completion logprobs' text_offset runs across chunks
            state.text_offset += len(tok.token_text(t))
    echoed = echo is not None and state.first
    if echo is not None and echoed:
        text = echo + text
    if ctx.chat:
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = ids if want_ids else None
        chunk: dict[str, Any] = {
            "id": ctx.request_id,
            "object": "chat.completion.chunk",
            "created": ctx.created,
            "model": ctx.model,
            "choices": [choice],
        }
    else:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "prompt_token_ids": req.prompt_ids if ((want_ids or echoed) and state.first) else None,
            "token_ids": ids if want_ids else None,
        }
        chunk = {
            "id": ctx.request_id,
            "object": "text_completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": [choice],
        }
    state.first = False
    if finish_reason is not None and not p.include_usage:
        chunk["system_fingerprint"] = ctx.fingerprint
    if p.continuous_usage:
        chunk["usage"] = usage(req, False, False)
    return sse(chunk)


def chat_role_chunk(ctx: ResponseContext, req: SimRequest, index: int = 0) -> bytes:
    """vLLM's first chat chunk: the role, empty content, and the prompt token ids."""
    p = ctx.parsed
    chunk: dict[str, Any] = {
        "id": ctx.request_id,
        "object": "chat.completion.chunk",
        "created": ctx.created,
        "model": ctx.model,
        "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
        "prompt_token_ids": req.prompt_ids if p.return_token_ids else None,
        "prompt_text": None,
    }
    if p.continuous_usage:
        n = len(req.prompt_ids)
        chunk["usage"] = {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}
    return sse(chunk)


def usage_chunk(ctx: ResponseContext, req: SimRequest, details: bool) -> bytes:
    return sse(
        {
            "id": ctx.request_id,
            "object": "chat.completion.chunk" if ctx.chat else "text_completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": [],
            "usage": usage(req, details, False, ctx.chat),
            "system_fingerprint": ctx.fingerprint,
        }
    )


def full_response(ctx: ResponseContext, req: SimRequest, text: str, details: bool) -> bytes:
    return orjson.dumps(full_body(ctx, req, text, details))


def full_body(ctx: ResponseContext, req: SimRequest, text: str, details: bool) -> dict[str, Any]:
    """The non-streaming answer of one request with one choice, as vLLM serializes it."""
    p = ctx.parsed
    lps = req.output_logprobs if p.want_logprobs else None
    k = p.sampling.logprobs or 0
    ids = list(req.output_ids) if p.return_token_ids else None
    if ctx.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": _chat_logprobs(lps, k) if lps is not None else None,
            "finish_reason": req.finish_reason,
            "stop_reason": req.stop_reason,
            "token_ids": ids,
            "routed_experts": None,
        }
        body: dict[str, Any] = {
            "id": ctx.request_id,
            "object": "chat.completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": ctx.fingerprint,
            "usage": usage(req, details, True),
            "prompt_logprobs": None,
            "prompt_token_ids": req.prompt_ids if p.return_token_ids else None,
            "prompt_text": None,
            "kv_transfer_params": req.kv_transfer_params_out,
            "ec_transfer_params": None,
            "metrics": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": _completion_logprobs(lps, k, 0) if lps is not None else None,
            "finish_reason": req.finish_reason,
            "stop_reason": req.stop_reason,
            "token_ids": ids,
            "prompt_logprobs": None,
            "prompt_token_ids": req.prompt_ids if p.return_token_ids else None,
            "routed_experts": None,
        }
        body = {
            "id": ctx.request_id,
            "object": "text_completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": ctx.fingerprint,
            "usage": usage(req, details, True),
            "kv_transfer_params": req.kv_transfer_params_out,
            "ec_transfer_params": None,
            "metrics": None,
        }
    return body
