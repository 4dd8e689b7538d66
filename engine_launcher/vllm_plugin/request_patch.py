"""API server: carry a validated `cache_hit_threshold` into SamplingParams.extra_args.

Upstream vLLM 0.32 accepts unknown top-level fields (OpenAIBaseModel has extra="allow") and
drops them; `vllm_xargs` reaches `SamplingParams.extra_args` unchanged. The seam is
`to_sampling_params` of CompletionRequest, ChatCompletionRequest and ResponsesRequest (the
Responses API copies `vllm_xargs` into the sampling parameters too, so without the patch a
bad value there would pass unchecked and the top-level field would be ignored): it runs for every
request before the engine sees it and before a stream starts, and a VLLMValidationError
raised there becomes vLLM's own 400 body
(`{"error": {"message": "... (parameter=cache_hit_threshold, value=1.5)", "type":
"BadRequestError", "param": "cache_hit_threshold", "code": 400}}`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .threshold import FIELD, ThresholdError, request_threshold

_PATCHED_ATTR = "_cachehit_threshold_patched"


def _threshold_of(request: Any) -> float | None:
    extra = getattr(request, "model_extra", None) or {}
    return request_threshold(extra.get(FIELD), getattr(request, "vllm_xargs", None))


# vLLM's request classes and their to_sampling_params, as the patch sees them: any request
# model, any arguments, a SamplingParams back.
ToSamplingParams = Callable[..., Any]


def _wrap_to_sampling_params(original: ToSamplingParams) -> ToSamplingParams:
    @functools.wraps(original)
    def to_sampling_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.exceptions import VLLMValidationError

        try:
            threshold = _threshold_of(self)
        except ThresholdError as exc:
            raise VLLMValidationError(str(exc), parameter=exc.param, value=exc.value) from None
        params = original(self, *args, **kwargs)
        if threshold is not None:
            extra = dict(params.extra_args or {})
            extra[FIELD] = threshold  # the top-level value wins over vllm_xargs
            params.extra_args = extra
        return params

    setattr(to_sampling_params, _PATCHED_ATTR, True)
    return to_sampling_params


def apply() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    # The Anthropic Messages API needs no patch of its own: vLLM converts its body into a
    # ChatCompletionRequest, `vllm_xargs` included (its model drops unknown top-level
    # fields, so there the threshold goes in `vllm_xargs`).
    for cls in (CompletionRequest, ChatCompletionRequest, ResponsesRequest):
        current = cls.to_sampling_params
        if not getattr(current, _PATCHED_ATTR, False):
            cls.to_sampling_params = _wrap_to_sampling_params(current)  # type: ignore[method-assign]  # the patch
