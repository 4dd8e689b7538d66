"""Why an answer is resumed (router/dispatch/resume.py)."""

from __future__ import annotations

from router.dispatch.resume import FAILURE, PREEMPTED, REJECTED, resume_reason
from router.engine.errors import UpstreamError


def test_resume_reasons() -> None:
    err = UpstreamError("b", "broken", "x")
    assert resume_reason("stop", 5, None, 5) is None
    assert resume_reason("cache_threshold", 5, None, 5) == PREEMPTED
    assert resume_reason("cache_threshold", 0, None, 5) == REJECTED
    assert resume_reason(None, 3, err, 3) == FAILURE
    assert resume_reason(None, 0, err, 0) is None  # before the first token: a retry, not a resume
