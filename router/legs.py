"""Bodies of the streamed upstream legs: probe, direct, decode and resume.

Every streamed leg asks the engine for a stream with usage and token ids whatever the
client asked (the router needs usage to learn prompt lengths and token ids to resume),
and carries the cache-hit threshold both top-level (llm-d's sidecar convention) and in
`vllm_xargs` (what reaches `SamplingParams.extra_args` in vLLM), merged with the client's
own `vllm_xargs`. The client's body is never mutated: legs copy it.
"""
from __future__ import annotations

THRESHOLD_KEY = "cache_hit_threshold"


def streamed_leg_body(body: dict, threshold: float) -> dict:
    out = dict(body)
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    out["return_token_ids"] = True
    out[THRESHOLD_KEY] = threshold
    xargs = body.get("vllm_xargs")
    out["vllm_xargs"] = {**xargs, THRESHOLD_KEY: threshold} if isinstance(xargs, dict) else {THRESHOLD_KEY: threshold}
    return out
