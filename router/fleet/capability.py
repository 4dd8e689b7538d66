"""Does an engine run the cache-hit threshold? Asked once per backend, before probing it.

A stock vLLM ignores `cache_hit_threshold` (an unknown top-level field is dropped with a
warning; `vllm_xargs` entries nobody reads are kept unused), so it would accept every
probe and win every race whatever it holds. The check: a completion at T = 1.0 on a
random prompt, which no engine can hold all of. An engine with the threshold plugin (or
the simulator) rejects it (`finish_reason: "cache_threshold"`); one that generates is
stock: it is still routed to, directly and as a fallback, but never probed, and the
router warns once and shows it in `cachehit_router_backend_threshold_capable`.

The check runs with the `/health` checks: at start (before the router serves) and whenever
a backend answers its health checks with its capability unknown: first contact, back after
it stopped answering (it may have been replaced by another engine), or the check itself
was not answered (an engine failing requests; asked again every `health.check_interval_s`).
Until an engine has answered, it is probed as if it ran the threshold.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from router.engine.client import MAX_CHECK_BYTES, UpstreamClient
from router.engine.errors import UpstreamError
from router.engine.wire import capability_check_body, is_rejection_chunk

log = logging.getLogger("cachehit_router.capability")

CHECK_PATH = "/v1/completions"


# The check's prompt starts with this (then random hex): recognizable in engine logs.
CHECK_PROMPT_PREFIX = "cachehit-router threshold check "


def check_body(model: str | None) -> dict[str, Any]:
    """A one-token completion at T = 1.0 on a prompt no engine holds."""
    return capability_check_body(CHECK_PROMPT_PREFIX + os.urandom(16).hex(), model)


def verdict(answer: dict[str, Any]) -> bool | None:
    """True: rejected as the plugin does; False: generated (stock vLLM); None: unclear. The
    answer's one choice is read as a race reads a leg's first chunk (router/engine/wire.py)."""
    return is_rejection_chunk(answer)


async def threshold_capable(
    client: UpstreamClient, name: str, url: str, api_key: str, model: str | None, timeout_s: float
) -> bool | None:
    """The engine's answer to the check; None when it could not be asked (tried again at
    the next health round)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        answer = await client.post_json(
            name, url, CHECK_PATH, check_body(model), api_key=api_key, total_deadline=deadline, limit=MAX_CHECK_BYTES
        )
    except UpstreamError as e:
        log.info("backend %s: threshold check not answered (%s); trying again later", name, e.kind)
        return None
    return verdict(answer)


def report(name: str, capable: bool) -> None:
    if capable:
        log.info("backend %s: runs the cache-hit threshold", name)
    else:
        log.warning(
            "backend %s: accepted a probe at cache_hit_threshold = 1.0 on a random prompt: "
            "it does not run the threshold plugin (a stock vLLM?). It is routed to without "
            "probes (directly and as a fallback); install the plugin (docs/VLLM_PLUGIN.md) "
            "to route to it by cache hits.",
            name,
        )
