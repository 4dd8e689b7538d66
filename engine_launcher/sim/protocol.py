"""Parsing and validation of /v1/completions and /v1/chat/completions bodies.

Bad input gets vLLM's error body `{"error": {"message", "type", "param", "code"}}`
(api_errors.py) and status: 400 for wrong types or out-of-range values (type "Bad Request" for schema errors,
as vLLM's validation handler writes them, "BadRequestError" for value checks), 404
"NotFoundError" for an unknown model. Fields the simulator does not model (temperature,
top_p, penalties, ...) are type-checked and otherwise ignored.

Batched prompts, `n` > 1, `echo` and `prompt_logprobs` are served as vLLM serves them
(engine_launcher/sim/multi.py). Documented limits: no tools, no beam search, no `echo`
together with `logprobs` (400 when requested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import tokenizer as tok
from .api_errors import ApiError, schema_error, value_error
from .config import SimEngineConfig
from .request import KvParams, SamplingSpec


def _check_sampling_ranges(temperature: Any, top_k: Any, penalties: dict[str, Any]) -> None:
    """The rest of vLLM's SamplingParams._verify_args ranges (vllm/sampling_params.py);
    those errors carry no parameter there, so none here either."""
    if temperature is not None and temperature > 2:
        raise value_error(
            f"temperature must be in [0, 2], got {float(temperature)}.", "temperature", float(temperature)
        )
    for key in ("presence_penalty", "frequency_penalty"):
        v = penalties.get(key)
        if v is not None and not -2.0 <= v <= 2.0:
            raise ApiError(f"{key} must be in [-2, 2], got {float(v)}.")
    rep = penalties.get("repetition_penalty")
    if rep is not None and rep <= 0:
        raise ApiError(f"repetition_penalty must be greater than zero, got {float(rep)}.")
    if top_k is not None and top_k < -1:
        raise ApiError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = penalties.get("min_p")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ApiError(f"min_p must be in [0, 1], got {float(min_p)}.")


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
    kv_transfer_params: KvParams | None
    # Every prompt of a batch (prompt_ids is the first) and, for echo, each one's text.
    prompts: tuple[list[int], ...] = ()
    prompt_texts: tuple[str, ...] = ()
    n: int = 1
    echo: bool = False
    prompt_logprobs: int | None = None
    request_id: str | None = None

    @property
    def single(self) -> bool:
        """One choice of one prompt, nothing but the generated tokens: the common path."""
        return self.n == 1 and len(self.prompts) <= 1 and not self.echo and self.prompt_logprobs is None


_MISSING = object()


class _Body:
    """Typed access to the JSON body with vLLM-shaped errors."""

    def __init__(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise ApiError(
                "1 validation error:\n  {'type': 'model_attributes_type', 'loc': "
                "'body', 'msg': 'Input should be a valid dictionary or object to "
                "extract fields from'}",
                400,
                "Bad Request",
                "body",
            )
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
            raise schema_error(key, kind, v)
        return v


def _check_threshold(value: Any, param: str) -> float | None:
    """As the threshold plugin (engine_launcher/vllm_plugin/threshold.py) words it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise value_error(
            f"{param} must be a number between 0 and 1, got {type(value).__name__} {value!r}", param, value
        )
    if not 0.0 <= float(value) <= 1.0:
        raise value_error(f"{param} must be between 0 and 1, got {float(value)}", param, float(value))
    return float(value)


def parse_threshold(body: dict[str, Any]) -> float | None:
    """Top-level `cache_hit_threshold` wins over `vllm_xargs.cache_hit_threshold`; both
    must be numbers in [0, 1] when present."""
    top = _check_threshold(body.get("cache_hit_threshold"), "cache_hit_threshold")
    xargs = body.get("vllm_xargs")
    xarg = _check_threshold(
        xargs.get("cache_hit_threshold") if isinstance(xargs, dict) else None, "vllm_xargs.cache_hit_threshold"
    )
    return top if top is not None else xarg


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _stop_list(b: _Body) -> tuple[str, ...]:
    v = b.raw.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(s for s in v if s)
    raise schema_error("stop", "str", v)


def _stop_token_ids(b: _Body) -> frozenset[int]:
    v = b.get("stop_token_ids", "list", [])
    if not all(_is_int(t) for t in v):
        raise schema_error("stop_token_ids", "list", v)
    return frozenset(v)


MAX_N = 16384
MAX_PROMPTS = 1024
_EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."


def _prompts(b: _Body) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids and text (a batch is a list of strings or id lists)."""
    p = b.raw.get("prompt")
    batch = p if isinstance(p, list) and p and not all(_is_int(x) for x in p) else [p]
    ids = [_prompt_ids(x) for x in batch]
    return ids, [x if isinstance(x, str) else tok.decode(i) for x, i in zip(batch, ids, strict=True)]


def _prompt_ids(p: Any) -> list[int]:
    if isinstance(p, str) and p:
        return tok.encode(p)
    if isinstance(p, list) and p and all(_is_int(x) for x in p):
        for t in p:
            if t < 0:
                raise schema_error("prompt", "greater than or equal to 0", t)
            if not tok.is_valid_id(t):
                raise value_error(f"Token id {t} is out of vocabulary", "prompt", t)
        return list(p)
    if p is None or p == "" or p == []:
        raise value_error(_EMPTY_PROMPT, "prompt")
    raise schema_error("prompt", "str", p)


def _chat_prompt_ids(b: _Body) -> list[int]:
    msgs = b.raw.get("messages")
    if not isinstance(msgs, list):
        raise schema_error("messages", "list", msgs)
    if not msgs:
        raise value_error("messages must be a non-empty list.", "messages")
    rendered: list[dict[str, str]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise schema_error(f"messages.{i}.role", "str", m)
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise value_error("The simulator accepts text content parts only.", f"messages.{i}.content")
                parts.append(part["text"])
            text = "\n".join(parts)
        else:
            raise schema_error(f"messages.{i}.content", "str", content)
        rendered.append({"role": m["role"], "content": text})
    return tok.encode(tok.render_chat(rendered))


def parse_request(raw: Any, cfg: SimEngineConfig, chat: bool) -> ParsedRequest:
    b = _Body(raw)
    model = b.get("model", "str", cfg.model)
    if model != cfg.model and model not in cfg.lora_modules:
        raise ApiError(
            f"The model `{model}` does not exist. Valid aliases: {cfg.model}.", 404, "NotFoundError", "model"
        )
    # Type checks first (pydantic validates the whole model before any value check).
    stream = b.get("stream", "bool", False)
    stream_options = b.get("stream_options", "dict")
    max_tokens = b.get("max_tokens", "int", None if chat else 16)
    mct = b.get("max_completion_tokens", "int") if chat else None
    min_tokens = b.get("min_tokens", "int", 0)
    n = b.get("n", "int", 1)
    seed = b.get("seed", "int")
    temperature = b.get("temperature", "number")
    top_p = b.get("top_p", "number")
    penalties = {
        key: b.get(key, "number") for key in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p")
    }
    top_k = b.get("top_k", "int")
    kv = b.get("kv_transfer_params", "dict")
    b.get("vllm_xargs", "dict")
    stop = _stop_list(b)
    stop_ids = _stop_token_ids(b)
    ignore_eos = bool(b.get("ignore_eos", "bool", False))
    include_stop = bool(b.get("include_stop_str_in_output", "bool", False))
    return_token_ids = bool(b.get("return_token_ids", "bool", False))
    if chat:
        want = bool(b.get("logprobs", "bool", False))
        top = b.get("top_logprobs", "int")
    else:
        top = b.get("logprobs", "int")
        want = top is not None

    if chat:
        prompts, texts = [_chat_prompt_ids(b)], list[str]()
    else:
        prompts, texts = _prompts(b)
    prompt_ids = prompts[0]
    # vLLM's limits (VLLM_MAX_N_SEQUENCES, VLLM_MAX_COMPLETION_PROMPTS defaults), worded as
    # vLLM words them.
    if n < 1:
        raise ApiError(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise ApiError(
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    if n > 1 and temperature is not None and temperature < 1e-5:
        raise ApiError(f"n must be 1 when using greedy sampling, got {n}.")
    if len(prompts) > MAX_PROMPTS:
        raise value_error(
            f"prompt list length {len(prompts)} exceeds the maximum allowed count of "
            f"{MAX_PROMPTS}. To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS "
            "environment variable.",
            "prompt",
        )
    if b.get("tools", "list"):
        raise value_error("The simulator does not support tools.", "tools")
    echo = not chat and bool(b.get("echo", "bool", False))
    if echo and want:
        raise value_error("The simulator does not support echo with logprobs.", "echo")
    prompt_logprobs = b.get("prompt_logprobs", "int")
    if prompt_logprobs is not None:
        if stream and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise value_error("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise value_error("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", prompt_logprobs)
    if b.get("use_beam_search", "bool", False):
        raise value_error("The simulator does not support beam search.", "use_beam_search")
    if temperature is not None and temperature < 0:
        raise value_error(
            f"temperature must be non-negative, got {float(temperature)}.", "temperature", float(temperature)
        )
    if top_p is not None and not 0 < top_p <= 1:
        raise value_error(f"top_p must be in (0, 1], got {float(top_p)}.", "top_p", float(top_p))
    _check_sampling_ranges(temperature, top_k, penalties)

    include_usage = continuous = False
    if stream_options is not None:
        if not stream:
            raise value_error("Stream options can only be defined when `stream=True`.", "stream_options")
        so = _Body(stream_options)
        include_usage = bool(so.get("include_usage", "bool", False))
        continuous = include_usage and bool(so.get("continuous_usage_stats", "bool", False))

    if mct is not None:
        max_tokens = mct
    prompt_len = max(len(x) for x in prompts)  # the longest of a batch
    context = cfg.context_len
    if prompt_len > context:
        raise value_error(
            f"This model's maximum context length is {context} tokens. However, "
            f"your prompt contains {prompt_len} input tokens, which exceeds this limit even "
            f"without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            prompt_len,
        )
    if max_tokens is not None and max_tokens > cfg.max_model_len:
        raise value_error(
            f"max_tokens={max_tokens} cannot be greater than "
            f"max_model_len={cfg.max_model_len}. Please request fewer output "
            f"tokens.",
            "max_tokens",
            max_tokens,
        )
    if max_tokens is not None and max_tokens < 1:
        raise value_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    # As vLLM's get_max_tokens: never past the context window.
    room = context - prompt_len
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    if max_tokens < 1:
        raise value_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if min_tokens < 0:
        raise value_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.", "min_tokens", min_tokens)
    if min_tokens > max_tokens:
        raise value_error(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            "min_tokens",
            min_tokens,
        )

    if chat:
        if top is not None and top > 0 and not want:
            raise value_error("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        k = (top or 0) if want else None
    else:
        k = top
    if k is not None and k < 0:
        raise value_error("logprobs must be non-negative.", "top_logprobs" if chat else "logprobs", k)
    if k is not None and k > cfg.max_logprobs:
        raise value_error(
            f"Requested sample logprobs of {k}, which is greater than max allowed: {cfg.max_logprobs}",
            "top_logprobs" if chat else "logprobs",
            k,
        )

    sampling = SamplingSpec(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop,
        stop_token_ids=stop_ids,
        include_stop_str_in_output=include_stop,
        ignore_eos=ignore_eos,
        seed=seed,
        logprobs=k,
    )
    return ParsedRequest(
        chat=chat,
        model=model,
        prompt_ids=prompt_ids,
        sampling=sampling,
        stream=bool(stream),
        include_usage=include_usage,
        continuous_usage=continuous,
        return_token_ids=return_token_ids,
        want_logprobs=want,
        threshold=parse_threshold(b.raw) if cfg.threshold_plugin else None,
        kv_transfer_params=kv,
        prompts=tuple(prompts),
        prompt_texts=tuple(texts),
        n=n,
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        request_id=b.get("request_id", "str"),
    )
