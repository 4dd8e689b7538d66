"""When an answer must be resumed, and why (the continuation's body is `wire.resume_leg_body`).

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

from router.engine.errors import UpstreamError
from router.engine.wire import CACHE_THRESHOLD

PREEMPTED = "preempted"  # cache_threshold after tokens
FAILURE = "failure"  # broken stream after the first token
REJECTED = "rejected"  # a decode/resume leg refused with no tokens (guard threshold)


def resume_reason(
    finish_reason: str | None, leg_tokens: int, error: UpstreamError | None, answer_tokens: int
) -> str | None:
    """Why the current leg must be continued, or None when the answer is complete.

    `leg_tokens`: tokens the leg produced; `answer_tokens`: tokens of the whole answer.
    """
    if error is not None:
        # Before the answer's first token a failure is a retry elsewhere, handled by the
        # caller like any pre-first-token failure; after it, the answer is resumed.
        return FAILURE if answer_tokens > 0 else None
    if finish_reason == CACHE_THRESHOLD:
        return PREEMPTED if leg_tokens > 0 else REJECTED
    return None
