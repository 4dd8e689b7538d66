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

The Anthropic Messages API (`/v1/messages`) is served from a ChatCompletionRequest that
`AnthropicServingMessages.to_chat_completion_request` builds, `vllm_xargs` included, so the
chat patch above validates and carries the threshold given there. Its request model
(a plain pydantic BaseModel) drops unknown top-level fields, so for the top-level
spelling the model is made to keep them, and the conversion is wrapped: a top-level
threshold is validated (the same 400, in vLLM's Anthropic error shape) and put into the
chat request's `vllm_xargs`, where it wins over a value already there, as the top-level
value does on every other route.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .threshold import FIELD, ThresholdError, request_threshold, validate_threshold

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


def _validation_error(exc: ThresholdError) -> Exception:
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(str(exc), parameter=exc.param, value=exc.value)


def _wrap_to_chat_completion_request(original: Callable[..., Any]) -> Any:
    """`original` is the classmethod's function: (cls, anthropic_request, ...) -> chat request."""

    @functools.wraps(original)
    def to_chat_completion_request(cls: Any, anthropic_request: Any, *args: Any, **kwargs: Any) -> Any:
        extra = getattr(anthropic_request, "model_extra", None) or {}
        try:
            threshold = validate_threshold(extra.get(FIELD), FIELD)
        except ThresholdError as exc:
            raise _validation_error(exc) from None
        chat_request = original(cls, anthropic_request, *args, **kwargs)
        if threshold is not None:
            chat_request.vllm_xargs = {**(chat_request.vllm_xargs or {}), FIELD: threshold}
        return chat_request

    setattr(to_chat_completion_request, _PATCHED_ATTR, True)
    return classmethod(to_chat_completion_request)


_ANTHROPIC_SERVING = "vllm.entrypoints.anthropic.serving"


def _patch_anthropic_serving(module: ModuleType) -> None:
    serving = module.AnthropicServingMessages
    current = serving.__dict__["to_chat_completion_request"]
    if not getattr(current.__func__, _PATCHED_ATTR, False):
        serving.to_chat_completion_request = _wrap_to_chat_completion_request(current.__func__)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches vLLM's Anthropic serving module when vLLM imports it (the API server, as it
    builds its app): importing it here would load the OpenAI serving stack into every
    process the plugin registers in (engine core, workers) for nothing."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _ANTHROPIC_SERVING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                # This one module's loader object only (a fresh one per find_spec).
                setattr(spec.loader, "exec_module", _then_patched(spec.loader.exec_module))  # noqa: B010
                return spec
        return None


def _then_patched(exec_module: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def exec_and_patch(module: ModuleType) -> None:
        exec_module(module)
        _patch_anthropic_serving(module)

    return exec_and_patch


def _apply_anthropic() -> None:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    if AnthropicMessagesRequest.model_config.get("extra") != "allow":
        # Keep unknown top-level fields (the threshold among them) in model_extra. The
        # route's validator is built when vLLM builds its app, after plugins register.
        AnthropicMessagesRequest.model_config["extra"] = "allow"
        AnthropicMessagesRequest.model_rebuild(force=True)
    loaded = sys.modules.get(_ANTHROPIC_SERVING)
    if loaded is not None:
        _patch_anthropic_serving(loaded)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def apply() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    for cls in (CompletionRequest, ChatCompletionRequest, ResponsesRequest):
        current = cls.to_sampling_params
        if not getattr(current, _PATCHED_ATTR, False):
            cls.to_sampling_params = _wrap_to_sampling_params(current)  # type: ignore[method-assign]  # the patch
    _apply_anthropic()
