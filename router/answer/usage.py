"""Usage totals over an answer's legs, as the client sees them: one engine's usage for its request.

- prompt_tokens: the client's prompt, i.e. the first non-resume leg's usage (a resume
  leg's prompt also holds generated tokens), else the length of the prompt token ids;
- completion_tokens: the sum over legs (a leg's usage chunk, else the token ids it sent);
- prompt_tokens_details: from the first leg that generated tokens (the leg that actually
  processed the client's prompt for this answer), else from the first leg that reported
  usage; cached_tokens is capped at prompt_tokens, since a resume leg's cache can cover
  generated tokens too;
- completion_tokens_details.reasoning_tokens: summed over the legs that report it.
"""

from __future__ import annotations

from typing import Any

from router.answer.progress import Answer
from router.engine.wire import Usage


class UsageTotals:
    """Per-leg usage folded into the answer's totals; reads the answer's token counts."""

    def __init__(self, answer: Answer, *, chat: bool):
        self._answer = answer
        self._chat = chat
        self._leg_completion_tokens: int | None = None  # the current leg's usage, if it sent one
        self._completion_done = 0  # completion tokens of finished legs
        self._prompt_tokens: int | None = None
        self._prompt_details: dict[str, Any] | None = None
        self._details_productive = False
        self._reasoning_tokens: int | None = None

    def _leg_tokens(self) -> int:
        n = self._leg_completion_tokens
        leg = self._answer.leg_tokens
        return n if n is not None and n >= leg else leg

    def begin_leg(self) -> None:
        """A leg begins (before the answer counts it): the one before it is over."""
        if self._answer.legs:
            self._completion_done += self._leg_tokens()
        self._leg_completion_tokens = None

    def note(self, usage: Usage, *, is_resume: bool) -> None:
        """The current leg's usage chunk (after the answer has taken its completion count)."""
        self._leg_completion_tokens = usage.completion_tokens
        if not is_resume and self._prompt_tokens is None and usage.prompt_tokens is not None:
            self._prompt_tokens = usage.prompt_tokens
        details = usage.prompt_tokens_details
        if details is not None:
            productive = self._answer.leg_tokens > 0
            if self._prompt_details is None or (productive and not self._details_productive):
                self._prompt_details = details
                self._details_productive = productive
        if usage.reasoning_tokens is not None:
            self._reasoning_tokens = (self._reasoning_tokens or 0) + usage.reasoning_tokens

    def _client_prompt_tokens(self) -> int:
        if self._prompt_tokens is not None:
            return self._prompt_tokens
        ids = self._answer.prompt_token_ids
        return len(ids) if ids is not None else 0

    def _completion_tokens(self) -> int:
        return self._completion_done + (self._leg_tokens() if self._answer.legs else 0)

    def running(self) -> dict[str, Any]:
        """continuous_usage_stats: running totals, in vLLM's key order. Chat chunks also
        carry `completion_tokens_details` (null unless the engine counts reasoning tokens):
        vLLM passes it explicitly there and dumps with exclude_unset (chat serving.py);
        completion chunks do not have it."""
        p = self._client_prompt_tokens()
        n = self._completion_done + self._answer.leg_tokens
        if self._chat:
            return {
                "prompt_tokens": p,
                "total_tokens": p + n,
                "completion_tokens": n,
                "completion_tokens_details": None,
            }
        return {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}

    def totals(self, *, streaming: bool) -> dict[str, Any]:
        """Totals over legs. `streaming`: vLLM's usage chunk drops null fields; the
        non-streaming body writes every field."""
        p = self._client_prompt_tokens()
        n = self._completion_tokens()
        usage: dict[str, Any] = {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}
        details = self._prompt_details
        if details is not None:
            d = dict(details)
            if isinstance(d.get("cached_tokens"), int) and d["cached_tokens"] > p:
                d["cached_tokens"] = p
            if not streaming:
                d = {
                    "cached_tokens": d.get("cached_tokens"),
                    "created_cache_tokens": d.get("created_cache_tokens"),
                    "multimodal_tokens": d.get("multimodal_tokens"),
                    **d,
                }
        else:
            d = None
        ctd = {"reasoning_tokens": self._reasoning_tokens} if self._reasoning_tokens is not None else None
        if streaming:
            if d is not None:
                usage["prompt_tokens_details"] = d
            if ctd is not None:
                usage["completion_tokens_details"] = ctd
        else:
            usage["prompt_tokens_details"] = d
            usage["completion_tokens_details"] = ctd
        return usage
