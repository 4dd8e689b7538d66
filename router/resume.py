"""When to resume an answer, and the continuation request.

A decode leg can end early in two ways the client must not see:
- `finish_reason == "cache_threshold"` after it produced tokens: the engine preempted the
  request, lost its KV cache, and the guard threshold handed it back with what it made;
- the stream broke (engine died, connection lost, idle timeout) after the first token.
Either way the router continues with a completion request whose prompt is the original
prompt's token ids plus every generated token id, with the remaining budget, through the
same plan and execute steps as a fresh request. A leg rejected with no tokens at all is
not a resume but a retry of the same continuation at threshold 0.
"""
from __future__ import annotations

from .upstream import UpstreamError

PREEMPTED = "preempted"  # cache_threshold after tokens
FAILURE = "failure"  # broken stream after the first token
REJECTED = "rejected"  # a decode/resume leg refused with no tokens (guard threshold)

# Chat fields that mean the same in a completion request (vLLM 0.32 sampling params).
_SHARED_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "logit_bias", "bad_words", "allowed_token_ids",
    "vllm_xargs", "user", "priority", "truncate_prompt_tokens", "cache_salt",
)
# Completion fields that must not carry over to a continuation.
_COMPLETION_DROPPED = ("prompt", "echo", "suffix", "max_completion_tokens", "prompt_embeds")


def resume_reason(finish_reason: str | None, leg_tokens: int, error: UpstreamError | None,
                  answer_tokens: int) -> str | None:
    """Why the current leg must be continued, or None when the answer is complete.

    `leg_tokens`: tokens the leg produced; `answer_tokens`: tokens of the whole answer.
    """
    if error is not None:
        # Before the answer's first token a failure is a retry elsewhere, handled by the
        # caller like any pre-first-token failure; after it, the answer is resumed.
        return FAILURE if answer_tokens > 0 else None
    if finish_reason == "cache_threshold":
        return PREEMPTED if leg_tokens > 0 else REJECTED
    return None


def remaining_tokens(max_tokens: int | None, generated: int) -> int | None:
    return None if max_tokens is None else max_tokens - generated


def resume_leg_body(body: dict, endpoint: str, prompt_token_ids: list[int],
                    generated_token_ids: list[int], max_tokens: int | None) -> dict:
    """A `/v1/completions` body continuing `body` after `generated_token_ids`."""
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
