"""Parsing and validation of /v1/completions and /v1/chat/completions bodies.

Bad input gets vLLM's error body `{"error": {"message", "type", "param", "code"}}` and
status: 400 for wrong types or out-of-range values (type "Bad Request" for schema errors,
as vLLM's validation handler writes them, "BadRequestError" for value checks), 404
"NotFoundError" for an unknown model. Fields the simulator does not model (temperature,
top_p, penalties, ...) are type-checked and otherwise ignored.

Documented limits: one prompt per request and `n == 1` (400 otherwise), no `echo`, no
`prompt_logprobs`, no tools (400 when requested).
"""
from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from . import tokenizer as tok
from .config import SimEngineConfig
from .engine import SamplingSpec


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type or ("BadRequestError" if status == 400 else
                                     HTTPStatus(status).phrase.replace(" ", "") + "Error")
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.status}}


def _schema_error(param: str, expected: str, value: Any) -> ApiError:
    return ApiError(f"1 validation error:\n  {{'type': '{expected}', 'loc': 'body.{param}', "
                    f"'msg': 'Input should be {expected}', 'input': {value!r}}}",
                    400, "Bad Request", f"body.{param}")


@dataclass
class ParsedRequest:
    chat: bool
    model: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    # completions: `logprobs` (int); chat: `logprobs` true with `top_logprobs`.
    want_logprobs: bool
    threshold: float | None
    kv_transfer_params: dict | None


_MISSING = object()


class _Body:
    """Typed access to the JSON body with vLLM-shaped errors."""

    def __init__(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise ApiError("1 validation error:\n  {'type': 'model_attributes_type', 'loc': "
                           "'body', 'msg': 'Input should be a valid dictionary or object'}",
                           400, "Bad Request", "body")
        self.raw = raw

    def get(self, key: str, kind: str, default: Any = None, *, nullable: bool = True) -> Any:
        v = self.raw.get(key, _MISSING)
        if v is _MISSING or (v is None and nullable):
            return default
        ok = {
            "int": isinstance(v, int) and not isinstance(v, bool),
            "number": isinstance(v, (int, float)) and not isinstance(v, bool),
            "bool": isinstance(v, bool),
            "str": isinstance(v, str),
            "dict": isinstance(v, dict),
            "list": isinstance(v, list),
        }[kind]
        if not ok:
            expected = {"int": "a valid integer", "number": "a valid number",
                        "bool": "a valid boolean", "str": "a valid string",
                        "dict": "a valid dictionary", "list": "a valid list"}[kind]
            raise _schema_error(key, expected, v)
        return v


def parse_threshold(body: dict) -> float | None:
    """Top-level `cache_hit_threshold` wins over `vllm_xargs.cache_hit_threshold`; each
    must be a number in [0, 1]."""
    def check(v: Any, param: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ApiError(f"cache_hit_threshold must be a number in [0, 1], got {v!r}",
                           param=param)
        return float(v)

    top = body.get("cache_hit_threshold")
    xargs = body.get("vllm_xargs")
    from_xargs = xargs.get("cache_hit_threshold") if isinstance(xargs, dict) else None
    if from_xargs is not None:
        from_xargs = check(from_xargs, "vllm_xargs.cache_hit_threshold")
    if top is not None:
        return check(top, "cache_hit_threshold")
    return from_xargs


def _stop_list(b: _Body) -> tuple[str, ...]:
    v = b.raw.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(s for s in v if s)
    raise _schema_error("stop", "a valid string or list of strings", v)


def _prompt_ids(b: _Body, cfg: SimEngineConfig) -> list[int]:
    p = b.raw.get("prompt")
    if isinstance(p, list) and len(p) > 0 and not all(isinstance(x, int) and not isinstance(x, bool)
                                                       for x in p):
        # A batch: a list of strings or a list of token-id lists.
        if len(p) != 1:
            raise ApiError(f"The simulator serves one prompt per request, got {len(p)}",
                           param="prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise ApiError("Either prompt or prompt_embeds must be provided and non-empty.",
                           param="prompt")
        return tok.encode(p)
    if isinstance(p, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        if not p:
            raise ApiError("Either prompt or prompt_embeds must be provided and non-empty.",
                           param="prompt")
        for t in p:
            if t < 0:
                raise _schema_error("prompt", "greater than or equal to 0", t)
            if not tok.is_valid_id(t):
                raise ApiError(f"Token id {t} is out of vocabulary", param="prompt")
        return list(p)
    if p is None:
        raise ApiError("Either prompt or prompt_embeds must be provided and non-empty.",
                       param="prompt")
    raise _schema_error("prompt", "a valid string or list of token ids", p)


def _chat_prompt_ids(b: _Body) -> list[int]:
    msgs = b.get("messages", "list")
    if not msgs:
        raise _schema_error("messages", "a non-empty list of messages", msgs)
    rendered: list[dict[str, str]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _schema_error(f"messages.{i}", "a message with a string role", m)
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ApiError("The simulator accepts text content parts only",
                                   param=f"messages.{i}.content")
                parts.append(part["text"])
            text = "\n".join(parts)
        else:
            raise _schema_error(f"messages.{i}.content", "a valid string or list of parts",
                                content)
        rendered.append({"role": m["role"], "content": text})
    return tok.encode(tok.render_chat(rendered))


def parse_request(raw: Any, cfg: SimEngineConfig, chat: bool) -> ParsedRequest:
    b = _Body(raw)
    model = b.get("model", "str", cfg.model)
    if model != cfg.model:
        raise ApiError(f"The model `{model}` does not exist. Valid aliases: {cfg.model}.",
                       404, "NotFoundError", "model")
    prompt_ids = _chat_prompt_ids(b) if chat else _prompt_ids(b, cfg)

    n = b.get("n", "int", 1)
    if n != 1:
        raise ApiError(f"The simulator supports n=1 only, got n={n}", param="n")
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty",
                "repetition_penalty", "min_p"):
        b.get(key, "number")
    b.get("top_k", "int")
    if b.get("tools", "list"):
        raise ApiError("The simulator does not support tools", param="tools")
    if not chat and b.get("echo", "bool", False):
        raise ApiError("The simulator does not support echo", param="echo")
    if b.get("prompt_logprobs", "int") is not None:
        raise ApiError("The simulator does not support prompt_logprobs", param="prompt_logprobs")
    if b.get("use_beam_search", "bool", False):
        raise ApiError("The simulator does not support beam search", param="use_beam_search")

    stream = b.get("stream", "bool", False)
    stream_options = b.get("stream_options", "dict")
    include_usage = continuous = False
    if stream_options is not None:
        if not stream:
            raise ApiError("Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        so = _Body(stream_options)
        include_usage = bool(so.get("include_usage", "bool", False))
        continuous = include_usage and bool(so.get("continuous_usage_stats", "bool", False))

    max_tokens = b.get("max_tokens", "int", None if chat else 16)
    if chat:
        mct = b.get("max_completion_tokens", "int")
        if mct is not None:
            max_tokens = mct
    prompt_len = len(prompt_ids)
    if prompt_len > cfg.max_model_len:
        raise ApiError(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
            f"your prompt contains {prompt_len} input tokens, which exceeds this limit even "
            f"without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens")
    if max_tokens is not None and max_tokens > cfg.max_model_len:
        raise ApiError(f"max_tokens={max_tokens} cannot be greater than "
                       f"max_model_len={cfg.max_model_len}. Please request fewer output tokens.",
                       param="max_tokens")
    room = cfg.max_model_len - prompt_len
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    if max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    min_tokens = b.get("min_tokens", "int", 0)
    if min_tokens < 0:
        raise ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
                       param="min_tokens")
    if min_tokens > max_tokens:
        raise ApiError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                       f"got {min_tokens}.", param="min_tokens")

    seed = b.get("seed", "int")
    if chat:
        want = bool(b.get("logprobs", "bool", False))
        top = b.get("top_logprobs", "int")
        if top is not None and top > 0 and not want:
            raise ApiError("when using `top_logprobs`, `logprobs` must be set to true.",
                           param="top_logprobs")
        k = (top or 0) if want else None
    else:
        k = b.get("logprobs", "int")
        want = k is not None
    if k is not None and not 0 <= k <= cfg.max_logprobs:
        raise ApiError(f"Requested sample logprobs of {k}, which is greater than max allowed: "
                       f"{cfg.max_logprobs}" if k > 0 else "logprobs must be non-negative.",
                       param="top_logprobs" if chat else "logprobs")

    kv = b.get("kv_transfer_params", "dict")
    xargs = b.get("vllm_xargs", "dict")
    del xargs
    sampling = SamplingSpec(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=_stop_list(b),
        include_stop_str_in_output=bool(b.get("include_stop_str_in_output", "bool", False)),
        ignore_eos=bool(b.get("ignore_eos", "bool", False)),
        seed=seed,
        logprobs=k,
    )
    return ParsedRequest(
        chat=chat, model=model, prompt_ids=prompt_ids, sampling=sampling, stream=bool(stream),
        include_usage=include_usage, continuous_usage=continuous,
        return_token_ids=bool(b.get("return_token_ids", "bool", False)),
        want_logprobs=want, threshold=parse_threshold(b.raw), kv_transfer_params=kv)
