"""vLLM 0.32's serving layer in miniature: the stream and the non-streaming body that one
engine sends for the same generation, transcribed from
vllm/entrypoints/openai/{completion,chat_completion}/serving.py and their protocol.py.

- stream chunks are `model_dump_json(exclude_unset=True)`: fields passed to the
  constructor are present even when null (`logprobs`, `finish_reason`, `token_ids`, the
  role chunk's `prompt_token_ids`/`prompt_text`, `stop_reason` only on the finish chunk);
- the usage chunk drops null fields (`exclude_none=True`);
- the non-streaming body is `model_dump()`: every field, nulls included, and a chat
  message's `tool_calls` dropped when empty.

A generation is a list of `Step`s, one per engine output (one chunk each).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Step:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # per token: (decoded token, logprob, {top token: logprob}) when logprobs were asked
    logprobs: list[tuple[str, float, dict[str, float]]] | None = None


@dataclass
class Gen:
    prompt_token_ids: list[int]
    steps: list[Step]
    cached_tokens: int | None = None  # None: --enable-prompt-tokens-details off
    model: str = "tiny"
    request_id: str = "cmpl-engine"
    created: int = 1_700_000_000
    system_fingerprint: str | None = None
    # request options
    return_token_ids: bool = True
    include_usage: bool = True
    logprobs: int | None = None  # completions `logprobs` / chat `top_logprobs`
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.steps)


def _completion_logprobs(steps: list[Step], start: int) -> tuple[dict[str, Any], int]:
    offsets, lps, toks, tops = [], [], [], []
    off = start
    for s in steps:
        for tok, lp, top in s.logprobs or ():
            offsets.append(off)
            lps.append(lp)
            toks.append(tok)
            tops.append(dict(top))
            off += len(tok)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": toks, "top_logprobs": tops}, off


def _usage_stream(g: Gen) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": len(g.prompt_token_ids),
        "total_tokens": len(g.prompt_token_ids) + g.completion_tokens,
        "completion_tokens": g.completion_tokens,
    }
    if g.cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": g.cached_tokens}
    return u


def _usage_full(g: Gen) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": len(g.prompt_token_ids),
        "total_tokens": len(g.prompt_token_ids) + g.completion_tokens,
        "completion_tokens": g.completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    if g.cached_tokens is not None:
        u["prompt_tokens_details"] = {
            "cached_tokens": g.cached_tokens,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        }
    return u


def _stamp_terminal(g: Gen, s: Step, chunk: dict[str, Any]) -> None:
    # "Stamp on terminal chunk only when no trailing usage chunk will follow."
    if not g.include_usage and g.system_fingerprint is not None and s.finish_reason is not None:
        chunk["system_fingerprint"] = g.system_fingerprint


# --- completions ------------------------------------------------------------------------


def completion_stream(g: Gen) -> list[dict[str, Any]]:
    out = []
    off = 0
    for k, s in enumerate(g.steps):
        lp = None
        if g.logprobs is not None:
            lp, off = _completion_logprobs([s], off)
        out.append(
            {
                "id": g.request_id,
                "object": "text_completion",
                "created": g.created,
                "model": g.model,
                "choices": [
                    {
                        "index": 0,
                        "text": s.text,
                        "logprobs": lp,
                        "finish_reason": s.finish_reason,
                        "stop_reason": s.stop_reason,
                        "prompt_token_ids": g.prompt_token_ids if k == 0 and g.return_token_ids else None,
                        "token_ids": list(s.token_ids) if g.return_token_ids else None,
                    }
                ],
            }
        )
        _stamp_terminal(g, s, out[-1])
    if g.include_usage:
        u = {
            "id": g.request_id,
            "object": "text_completion",
            "created": g.created,
            "model": g.model,
            "choices": [],
            "usage": _usage_stream(g),
        }
        if g.system_fingerprint is not None:
            u["system_fingerprint"] = g.system_fingerprint
        out.append(u)
    return out


def completion_full(g: Gen) -> dict[str, Any]:
    last = g.steps[-1] if g.steps else Step("", [])
    lp = _completion_logprobs(g.steps, 0)[0] if g.logprobs is not None else None
    ids = [t for s in g.steps for t in s.token_ids]
    return {
        "id": g.request_id,
        "object": "text_completion",
        "created": g.created,
        "model": g.model,
        "choices": [
            {
                "index": 0,
                "text": "".join(s.text for s in g.steps),
                "logprobs": lp,
                "finish_reason": last.finish_reason,
                "stop_reason": last.stop_reason,
                "token_ids": ids if g.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": g.prompt_token_ids if g.return_token_ids else None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": g.system_fingerprint,
        "usage": _usage_full(g),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


# --- chat ---------------------------------------------------------------------------------


def _chat_logprobs(steps: list[Step], k: int) -> dict[str, Any]:
    content = []
    for s in steps:
        for tok, lp, top in s.logprobs or ():
            content.append(
                {
                    "token": tok,
                    "logprob": lp,
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": v, "bytes": list(t.encode())}
                        for i, (t, v) in enumerate(top.items())
                        if i < k
                    ],
                }
            )
    return {"content": content}


def chat_stream(g: Gen) -> list[dict[str, Any]]:
    head = {"id": g.request_id, "object": "chat.completion.chunk", "created": g.created, "model": g.model}
    out = [
        {
            **head,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
            "prompt_token_ids": g.prompt_token_ids if g.return_token_ids else None,
            "prompt_text": None,
        }
    ]
    for s in g.steps:
        lp = _chat_logprobs([s], g.logprobs or 0) if g.logprobs is not None else None
        choice = {"index": 0, "delta": {"content": s.text}, "logprobs": lp, "finish_reason": s.finish_reason}
        if s.finish_reason is not None:
            choice["stop_reason"] = s.stop_reason
        choice["token_ids"] = list(s.token_ids) if g.return_token_ids else None
        out.append({**head, "choices": [choice]})
        _stamp_terminal(g, s, out[-1])
    if g.include_usage:
        u = {**head, "choices": [], "usage": _usage_stream(g)}
        if g.system_fingerprint is not None:
            u["system_fingerprint"] = g.system_fingerprint
        out.append(u)
    return out


def chat_full(g: Gen) -> dict[str, Any]:
    last = g.steps[-1] if g.steps else Step("", [])
    ids = [t for s in g.steps for t in s.token_ids]
    return {
        "id": g.request_id,
        "object": "chat.completion",
        "created": g.created,
        "model": g.model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "".join(s.text for s in g.steps),
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": _chat_logprobs(g.steps, g.logprobs or 0) if g.logprobs is not None else None,
                "finish_reason": last.finish_reason or "stop",
                "stop_reason": last.stop_reason,
                "token_ids": ids if g.return_token_ids else None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": g.system_fingerprint,
        "usage": _usage_full(g),
        "prompt_logprobs": None,
        "prompt_token_ids": g.prompt_token_ids if g.return_token_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
