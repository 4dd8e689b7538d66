"""The cache-hit threshold (vLLM RFC 24256) as a vLLM 0.32 plugin.

Registered through the `vllm.general_plugins` entry point (`cachehit_threshold =
"engine_launcher.vllm_plugin:register"` in pyproject.toml). vLLM calls `register()` early in
every one of its processes (API server, engine core, workers); it must be idempotent.

What it does in each process:
- adds the `cache_threshold` finish reason to vLLM's enums (`finish_reason`), which has to
  happen everywhere before the first engine output is decoded;
- patches the OpenAI request models so a per-request `cache_hit_threshold` (top-level or in
  `vllm_xargs`) is validated (400) and reaches the engine (`request_patch`);
- patches `AsyncLLM.generate` so a rejected stream keeps its finishing chunk (`stream_patch`);
- with `CACHEHIT_NIXL_PROGRESS_DELAY_US` set, gives NIXL's progress thread a poll delay so an
  idle engine does not spin a core (`nixl_progress`).

The scheduling itself needs `--scheduler-cls engine_launcher.vllm_plugin.scheduler.
ThresholdScheduler` (or `ThresholdAsyncScheduler`): see `scheduler` and docs/VLLM_PLUGIN.md.

On a vLLM outside the supported series, `register()` patches nothing and logs an error (so
installing this package never breaks an unrelated vLLM), and the scheduler classes refuse to
start the engine with a message naming the supported versions.
"""

from __future__ import annotations

import logging

from .version import UnsupportedVLLMVersion, check_vllm_version

logger = logging.getLogger("vllm.plugins.cachehit_threshold")

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    try:
        version = check_vllm_version()
    except UnsupportedVLLMVersion as exc:
        logger.error("%s", exc)
        return
    from . import finish_reason, nixl_progress, request_patch, stream_patch

    finish_reason.ensure_extended()
    request_patch.apply()
    stream_patch.apply()
    nixl_progress.apply()
    _registered = True
    logger.debug("cache-hit threshold plugin registered for vLLM %s", version)


__all__ = ["register"]
