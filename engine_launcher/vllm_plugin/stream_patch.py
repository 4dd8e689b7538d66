"""API server: make a zero-token `cache_threshold` finish visible, and count rejections.

The problem: vLLM 0.32's stream generators (completion/serving.py
`completion_stream_generator`, chat_completion/serving.py `chat_completion_stream_generator`)
skip an output whose text and token ids are empty while nothing was generated before
("Chunked prefill case, don't return empty chunks"). A request rejected by the threshold
finishes with exactly that, so its finishing choice would vanish and the client would see
only `[DONE]` (chat: the role-only chunk, then `[DONE]`).

The seam: `AsyncLLM.generate`, the one async generator every OpenAI handler reads
`RequestOutput`s from. For a finished `cache_threshold` output with no text and no tokens
the wrapper replaces `text` by an empty string that is truthy (`VisibleEmptyText`), so the
serving layer's skip test lets it through, and everything else — the role chunk, the
finishing chunk with `prompt_token_ids`/`token_ids: []`, the usage chunk, the fingerprint,
`[DONE]` — is vLLM's own code. The value still serializes as "".

The scheduler marks each rejection in the output's `kv_transfer_params` (the only free-form
field an EngineCoreOutput carries to the API server) with the stage and hit counts; the
wrapper removes the mark before the serving layer sees it, reports the hit of a first
rejection (arrival or admission) as the usage's `prompt_tokens_details.cached_tokens`, and
counts it in
`cachehit_threshold_rejections_total{stage}` (not in the `vllm:` namespace: vLLM unregisters
every `vllm:` collector of the default registry when it sets up its own metrics). vLLM's own
`vllm:request_success_total{finished_reason="cache_threshold"}` counts the same requests
without the stage.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import Counter

from .finish_reason import CACHE_THRESHOLD

logger = logging.getLogger("vllm.plugins.cachehit_threshold")

# Key of the scheduler's mark inside EngineCoreOutput.kv_transfer_params.
REJECTION_MARK = "_cachehit_rejection"
STAGES = ("arrival", "admission", "readmission")
_PATCHED_ATTR = "_cachehit_generate_patched"
_counter: Counter | None = None


class VisibleEmptyText(str):
    """An empty string that is truthy: passes `if not delta_text` skips, renders as ""."""

    def __bool__(self) -> bool:
        return True


def rejections_counter() -> Counter:
    global _counter
    if _counter is None:
        from prometheus_client import Counter

        _counter = Counter(
            "cachehit_threshold_rejections",
            "Requests finished with finish_reason cache_threshold, by stage: arrival (engine "
            "core add_request), admission (scheduler, first admission), readmission "
            "(scheduler, after a preemption).",
            labelnames=["stage"],
        )
        for stage in STAGES:
            _counter.labels(stage=stage)
    return _counter


def _take_mark(request_output: Any) -> dict[str, Any] | None:
    params = getattr(request_output, "kv_transfer_params", None)
    if not isinstance(params, dict) or REJECTION_MARK not in params:
        return None
    mark = params.pop(REJECTION_MARK)
    if not params:
        request_output.kv_transfer_params = None
    return mark if isinstance(mark, dict) else {}


def fix_request_output(request_output: Any) -> None:
    mark = _take_mark(request_output)
    outputs = getattr(request_output, "outputs", None) or ()
    rejected = False
    for completion in outputs:
        if getattr(completion, "finish_reason", None) != CACHE_THRESHOLD:
            continue
        rejected = True
        if not completion.text and not completion.token_ids:
            completion.text = VisibleEmptyText()
    if rejected or mark is not None:
        stage = (mark or {}).get("stage", "admission")
        hit = (mark or {}).get("hit_tokens")
        if stage in ("arrival", "admission") and isinstance(hit, int):
            # The rejection's usage says how much of the prompt this engine holds
            # (prompt_tokens_details.cached_tokens): a router sends the fallback to the
            # largest partial holder. The request never ran, so nothing else reports it.
            prompt = getattr(request_output, "prompt_token_ids", None) or ()
            request_output.num_cached_tokens = min(hit, len(prompt)) if prompt else hit
        try:
            rejections_counter().labels(stage=stage if stage in STAGES else "admission").inc()
        except Exception:  # metrics must never break serving
            logger.debug("cache_threshold metric update failed", exc_info=True)
        if mark:
            logger.debug(
                "request %s rejected by cache_hit_threshold: %s", getattr(request_output, "request_id", "?"), mark
            )


# AsyncLLM.generate as the patch sees it: an async generator of RequestOutput.
Generate = Callable[..., AsyncGenerator[Any, None]]


def _wrap_generate(original: Generate) -> Generate:
    @functools.wraps(original)
    async def generate(self: Any, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        agen = original(self, *args, **kwargs)
        try:
            async for request_output in agen:
                fix_request_output(request_output)
                yield request_output
        finally:
            # Closing our generator (client went away) must close vLLM's at once: that is
            # what aborts the request in the engine.
            await agen.aclose()

    setattr(generate, _PATCHED_ATTR, True)
    return generate


def apply() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    if not getattr(AsyncLLM.generate, _PATCHED_ATTR, False):
        AsyncLLM.generate = _wrap_generate(AsyncLLM.generate)  # type: ignore[method-assign]  # the patch
    rejections_counter()
