"""Driving the response shaper in tests: client request specs, generations as one engine
would describe them (support/vllm_serving.py), and those generations cut into legs."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import orjson

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, RequestSpec, parse_request
from router.answer.shaper import ResponseShaper
from router.engine.wire import CACHE_THRESHOLD
from support.vllm_serving import (
    Gen,
    Step,
    chat_stream,
    completion_stream,
)

PROMPT = [101, 102, 103, 104]


def make_spec(
    endpoint: str,
    *,
    stream: bool = True,
    include_usage: bool = False,
    return_token_ids: bool = False,
    logprobs: int | None = None,
    continuous: bool = False,
    model: str = "client-model",
) -> RequestSpec:
    body: dict[str, Any] = {"model": model}
    if endpoint == ENDPOINT_CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
        if logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, logprobs
    else:
        body["prompt"] = "hi"
        if logprobs is not None:
            body["logprobs"] = logprobs
    if stream:
        body["stream"] = True
        opts = {}
        if include_usage:
            opts["include_usage"] = True
        if continuous:
            opts["continuous_usage_stats"] = True
        if opts:
            body["stream_options"] = opts
    if return_token_ids:
        body["return_token_ids"] = True
    return parse_request(endpoint, orjson.dumps(body))


def client_view(spec: RequestSpec, g: Gen) -> Gen:
    """The same generation as the engine would describe it for the client's own request."""
    assert spec.model is not None  # make_spec always names one
    return Gen(
        prompt_token_ids=g.prompt_token_ids,
        steps=g.steps,
        cached_tokens=g.cached_tokens,
        model=spec.model,
        request_id=spec.request_id,
        created=spec.created,
        system_fingerprint=g.system_fingerprint,
        return_token_ids=spec.return_token_ids,
        include_usage=spec.include_usage,
        logprobs=g.logprobs,
    )


def run_legs(
    spec: RequestSpec, legs: list[tuple[bool, list[dict[str, Any]]]], *, release: bool = False
) -> tuple[ResponseShaper, list[dict[str, Any]]]:
    sh = ResponseShaper(spec)
    out: list[dict[str, Any]] = []
    for is_resume, chunks in legs:
        sh.begin_leg(is_resume=is_resume)
        for c in chunks:
            out.extend(sh.shape(c))
    if release:
        out.extend(sh.release_held())
    out.extend(sh.final_chunks())
    return sh, out


def tok(i: int, k: int = 2) -> tuple[str, float, dict[str, float]]:
    t = f"t{i}"
    return (t, -0.5 - i / 100, {t: -0.5 - i / 100, **{f"alt{i}_{j}": -2.0 - j for j in range(k)}})


def steps_for(n_tokens: int, finish: str = "length", logprobs: bool = False, per_step: int = 1) -> list[Step]:
    steps = []
    i = 0
    while i < n_tokens:
        ids = list(range(1000 + i, 1000 + min(n_tokens, i + per_step)))
        steps.append(
            Step(
                "".join(f"t{j}" for j in range(i, i + len(ids))),
                ids,
                logprobs=[tok(j) for j in range(i, i + len(ids))] if logprobs else None,
            )
        )
        i += len(ids)
    if steps:
        steps[-1].finish_reason = finish
        steps[-1].stop_reason = None
    return steps


def split_legs(
    endpoint: str, g: Gen, cuts: list[int], finish_on_last: list[bool], cached: list[int | None]
) -> list[tuple[bool, list[dict[str, Any]]]]:
    """Upstream legs for generation `g` interrupted after the given numbers of steps:
    every leg but the last ends in cache_threshold (on its last content chunk or in a
    chunk of its own); resume legs are completion streams with prompt + generated ids."""
    bounds = [0, *cuts, len(g.steps)]
    legs = []
    generated: list[int] = []
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        steps = copy.deepcopy(g.steps[a:b])
        last = n == len(bounds) - 2
        if not last:
            for s in steps:
                s.finish_reason = None
            if steps and finish_on_last[n]:
                steps[-1].finish_reason = CACHE_THRESHOLD
            else:
                steps.append(Step("", [], CACHE_THRESHOLD, logprobs=[] if g.logprobs is not None else None))
        leg = Gen(
            PROMPT + generated,
            steps,
            cached_tokens=cached[n],
            model="engine-model",
            request_id=f"engine-{n}",
            created=1000 + n,
            logprobs=g.logprobs,
            system_fingerprint=g.system_fingerprint,
        )
        resume = n > 0
        if resume or endpoint == ENDPOINT_COMPLETIONS:
            legs.append((resume, completion_stream(leg)))
        else:
            legs.append((False, chat_stream(leg)))
        generated += [t for s in steps for t in s.token_ids]
    return legs


def expected_cached(g_steps: list[Step], cuts: list[int], cached: list[int | None]) -> int | None:
    bounds = [0, *cuts, len(g_steps)]
    first_reported = None
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        leg_cached = cached[n]
        if leg_cached is None:
            continue
        if any(s.token_ids for s in g_steps[a:b]):
            return min(leg_cached, len(PROMPT))
        if first_reported is None:
            first_reported = min(leg_cached, len(PROMPT))
    return first_reported


def chat_chunk(delta: dict[str, Any], finish: str | None = None, ids: list[int] | None = None) -> dict[str, Any]:
    """One chat stream chunk of an engine, as a chat parser's delta (reasoning, tool calls) comes."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = ids or []
    return {"id": "chatcmpl-e", "object": "chat.completion.chunk", "created": 1, "model": "tiny", "choices": [choice]}
