"""The vLLM 0.32 wire format as the router speaks it: the bodies of every leg it sends, and
how it reads the chunks that come back (verdict, schema checks, usage, token counts).

Sent (docs/ARCHITECTURE.md, "Upstream legs the router sends"): every streamed leg asks for
a stream with usage and token ids whatever the client asked (the router needs usage to
learn prompt lengths and token ids to resume), and carries the cache-hit threshold both
top-level (llm-d's sidecar convention) and in `vllm_xargs` (what reaches
`SamplingParams.extra_args` in vLLM), merged with the client's own `vllm_xargs`. The
client's body is never mutated: legs copy it.

Received (docs/VLLM_WIRE.md): a chunk's verdict on a probe, the types of the fields the
router reads (an engine that breaks them is a protocol error, not a router crash), and the
`usage` object of a chunk or a non-streaming answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.readonly import readonly

# The generation routes the router sends legs to.
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

CACHE_THRESHOLD = "cache_threshold"
THRESHOLD_KEY = "cache_hit_threshold"
KV_TRANSFER_PARAMS = "kv_transfer_params"


# --- leg bodies ----------------------------------------------------------------------------


def streamed_leg_body(body: dict[str, Any], threshold: float) -> dict[str, Any]:
    """A probe at `threshold`, or a direct leg at 0 (explicit, to override an engine-wide
    default)."""
    out = dict(body)
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    out["return_token_ids"] = True
    out[THRESHOLD_KEY] = threshold
    xargs = body.get("vllm_xargs")
    out["vllm_xargs"] = {**xargs, THRESHOLD_KEY: threshold} if isinstance(xargs, dict) else {THRESHOLD_KEY: threshold}
    return out


def unary_leg_body(body: dict[str, Any], *, return_token_ids: bool = False) -> dict[str, Any]:
    """A non-streaming client's body forwarded as is to one engine; explicit T = 0, so an
    engine-wide default threshold does not reject a routed request. `return_token_ids`:
    the client's, which admission took out of `body` (the engine's answer is forwarded
    whole, so only the engine can add the ids)."""
    out = {**body, "stream": False, THRESHOLD_KEY: 0.0}
    if return_token_ids:
        out["return_token_ids"] = True
    return out


def whole_request_body(body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """A request only an engine can answer whole (n > 1, batches, echo...), as the client
    sent it: explicit T = 0, so an engine-wide default threshold does not reject it, and
    the router's id (without its prefix) in the body, which the engine names its answer
    after (a client's id need not be a valid header value)."""
    return {**body, THRESHOLD_KEY: 0.0, "request_id": request_id}


def capability_check_body(prompt: str, model: str | None) -> dict[str, Any]:
    """A one-token completion at T = 1.0 (top level and in `vllm_xargs`): an engine that runs
    the threshold rejects it on a prompt it does not hold; a stock vLLM generates."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        THRESHOLD_KEY: 1.0,
        "vllm_xargs": {THRESHOLD_KEY: 1.0},
    }
    if model:
        body["model"] = model
    return body


# What a probe for a request answered whole must not carry: one choice of one prompt and
# one token, nothing the race's stream reader does not expect.
_WHOLE_ONLY = (
    "n",
    "best_of",
    "use_beam_search",
    "echo",
    "prompt_logprobs",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "min_tokens",
)


def one_token_probe(body: dict[str, Any]) -> dict[str, Any]:
    """The body to race for a request answered whole: its (first) prompt, one token; the
    caller makes it a streamed leg."""
    out = {k: v for k, v in body.items() if k not in _WHOLE_ONLY}
    out["max_tokens"] = 1
    prompt = out.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        out["prompt"] = prompt[0]  # a batch races on its first prompt
    return out


PREFILL_REQUEST_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Fields that make no sense on a one-token, non-streaming prefill leg.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    """The NIXL producer's leg: one token, not streamed, asking for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out[KV_TRANSFER_PARAMS] = dict(PREFILL_REQUEST_PARAMS)
    return out


def decode_leg_body(body: dict[str, Any], kv_transfer_params: dict[str, Any], threshold: float) -> dict[str, Any]:
    """The NIXL consumer's leg: streamed, with the producer's params verbatim and the guard
    threshold."""
    out = streamed_leg_body(body, threshold)
    out[KV_TRANSFER_PARAMS] = kv_transfer_params
    return out


# Chat fields that mean the same in a completion request (vLLM 0.32 sampling params).
_SHARED_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "vllm_xargs",
    "user",
    "priority",
    "truncate_prompt_tokens",
    "cache_salt",
)
# Completion fields that must not carry over to a continuation.
_COMPLETION_DROPPED = ("prompt", "echo", "suffix", "max_completion_tokens", "prompt_embeds")


def remaining_tokens(max_tokens: int | None, generated: int) -> int | None:
    return None if max_tokens is None else max_tokens - generated


def resume_leg_body(
    body: dict[str, Any],
    endpoint: str,
    prompt_token_ids: Sequence[int],
    generated_token_ids: Sequence[int],
    max_tokens: int | None,
) -> dict[str, Any]:
    """A `/v1/completions` body continuing `body` after `generated_token_ids` (the caller
    makes it a streamed leg)."""
    if endpoint == "chat":
        out = {k: body[k] for k in _SHARED_SAMPLING_FIELDS if k in body}
        out["model"] = body.get("model")
        if body.get("logprobs"):
            out["logprobs"] = int(body.get("top_logprobs") or 0)
    else:
        out = {k: v for k, v in body.items() if k not in _COMPLETION_DROPPED}
    if out.get("model") is None:
        out.pop("model", None)
    out["prompt"] = list(prompt_token_ids) + list(generated_token_ids)
    generated = len(generated_token_ids)
    remaining = remaining_tokens(max_tokens, generated)
    if remaining is not None:
        out["max_tokens"] = remaining
    else:
        out.pop("max_tokens", None)
    for key in ("min_tokens",):
        if isinstance(body.get(key), int):
            out[key] = max(0, body[key] - generated)
    return out


# --- a probe's verdict -----------------------------------------------------------------------


def is_rejection_chunk(chunk: dict[str, Any]) -> bool | None:
    """Did the engine reject (True) or accept (False) the leg, or is it still undecided
    (None: role-only chat chunk, chat echo chunk, usage chunk, empty chunk)?

    Rejected: `finish_reason == "cache_threshold"` with nothing generated in the chunk.
    Accepted: the first chunk carrying generated text or token ids, or another finish
    reason. vLLM sends the chat role chunk (and, with `echo`, a chunk repeating the last
    message) on the request's first output, before the scheduler has decided anything,
    also for a request it then rejects (docs/VLLM_WIRE.md). Those are the only chat chunks
    without a `token_ids` key (every chunk of generated output has one, null when token
    ids were not asked for), which is how they are told apart from generated text.
    """
    choices = chunk.get("choices")
    if not choices:
        return None
    c = choices[0]
    if not isinstance(c, dict):
        return None
    fr = c.get("finish_reason")
    if fr == CACHE_THRESHOLD:
        return not (c.get("token_ids") or has_output(c))
    if fr is not None or c.get("token_ids"):
        return False
    if "delta" in c and "token_ids" not in c:
        return None
    return False if has_output(c) else None


def has_output(c: dict[str, Any]) -> bool:
    """Does the choice carry generated text (completion text, chat content, reasoning or
    tool calls)?"""
    if c.get("text"):
        return True
    d = c.get("delta")
    if isinstance(d, dict):
        return bool(d.get("content") or d.get("reasoning") or d.get("reasoning_content") or d.get("tool_calls"))
    return False


def generated_tokens(chunk: dict[str, Any]) -> int:
    """Tokens a chunk carries: its token ids, else one per choice with text."""
    n = 0
    for c in chunk.get("choices") or ():
        ids = c.get("token_ids")
        if ids:
            n += len(ids)
        elif c.get("text") or (c.get("delta") or {}).get("content"):
            n += 1
    return n


# --- usage -----------------------------------------------------------------------------------


def _count(v: Any) -> int | None:
    return v if isinstance(v, int) else None


@readonly
class Usage:
    """The fields of an engine's `usage` the router reads; None where absent or not a count."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # prompt_tokens_details.cached_tokens: the prompt tokens the engine held (its prefix
    # cache plus what its KV connector loads).
    cached_tokens: int | None = None
    prompt_tokens_details: dict[str, Any] | None = None
    reasoning_tokens: int | None = None  # completion_tokens_details.reasoning_tokens


NO_USAGE = Usage()


def parse_usage(usage: Any) -> Usage:
    """A `usage` object (NO_USAGE when it is not one)."""
    if not isinstance(usage, dict):
        return NO_USAGE
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = None
    cached = details.get("cached_tokens") if details is not None else None
    ctd = usage.get("completion_tokens_details")
    return Usage(
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None,
        prompt_tokens_details=details,
        reasoning_tokens=_count(ctd.get("reasoning_tokens")) if isinstance(ctd, dict) else None,
    )


def message_usage(message: dict[str, Any]) -> Usage:
    """The usage of a chunk or a non-streaming answer (NO_USAGE when it has none)."""
    return parse_usage(message.get("usage"))


# --- schema checks ---------------------------------------------------------------------------


class MalformedChunk(ValueError):
    """An upstream chunk the router cannot read (the engine broke the protocol)."""


def check_ids(ids: Any, what: str) -> None:
    if type(ids) is list:
        for t in ids:
            if type(t) is not int:
                break
        else:
            return
    raise MalformedChunk(f"upstream chunk: `{what}` is not a list of integers")


def check_choice(c: Any, *, chat: bool) -> None:
    """Types of the choice fields the shaper reads (cheap: a handful of type checks)."""
    if type(c) is not dict:
        raise MalformedChunk("upstream chunk: a choice is not an object")
    ids = c.get("token_ids")
    if ids is not None:
        check_ids(ids, "token_ids")
    fr = c.get("finish_reason")
    if fr is not None and type(fr) is not str:
        raise MalformedChunk("upstream chunk: `finish_reason` is not a string")
    lp = c.get("logprobs")
    if lp is not None:
        check_logprobs(lp)
    if chat:
        d = c.get("delta")
        if d is None:
            return
        if type(d) is not dict:
            raise MalformedChunk("upstream chunk: `delta` is not an object")
        if len(d) == 1 and type(d.get("content")) is str:
            return  # the common token chunk
        for k in ("role", "content", "reasoning", "reasoning_content"):
            v = d.get(k)
            if v is not None and type(v) is not str:
                raise MalformedChunk(f"upstream chunk: `delta.{k}` is not a string")
        tc = d.get("tool_calls")
        if tc is not None:
            if type(tc) is not list:
                raise MalformedChunk("upstream chunk: `delta.tool_calls` is not a list")
            for call in tc:
                if type(call) is not dict or type(call.get("index", 0)) is not int:
                    raise MalformedChunk("upstream chunk: a tool call delta without an integer `index`")
                f = call.get("function")
                if f is not None and (
                    type(f) is not dict
                    or any(f.get(k) is not None and type(f.get(k)) is not str for k in ("name", "arguments"))
                ):
                    raise MalformedChunk("upstream chunk: a tool call `function` is malformed")
    else:
        t = c.get("text")
        if t is not None and type(t) is not str:
            raise MalformedChunk("upstream chunk: `text` is not a string")


def check_logprobs(lp: Any) -> None:
    """Completion logprobs (parallel lists) or chat logprobs (`content` entries)."""
    if type(lp) is not dict:
        raise MalformedChunk("upstream chunk: `logprobs` is not an object")
    content = lp.get("content")
    if content is not None:
        if type(content) is not list or not all(type(e) is dict and type(e.get("token")) is str for e in content):
            raise MalformedChunk("upstream chunk: `logprobs.content` is malformed")
        return
    offsets = lp.get("text_offset")
    tokens = lp.get("tokens")
    if offsets is not None and (type(offsets) is not list or not all(type(o) is int for o in offsets)):
        raise MalformedChunk("upstream chunk: `logprobs.text_offset` is malformed")
    if tokens is not None and (type(tokens) is not list or not all(type(t) is str for t in tokens)):
        raise MalformedChunk("upstream chunk: `logprobs.tokens` is malformed")
    for k in ("token_logprobs", "top_logprobs"):
        v = lp.get(k)
        if v is not None and type(v) is not list:
            raise MalformedChunk(f"upstream chunk: `logprobs.{k}` is not a list")
