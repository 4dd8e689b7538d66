"""Driving the response shaper in tests: client request specs, generations as one engine
would describe them (support/vllm_serving.py), and those generations cut into legs."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import orjson
from hypothesis import strategies as st

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, RequestSpec, parse_request
from router.answer.shaper import ResponseShaper
from router.engine.sse import format_event
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
    max_tokens: int | None = None,
) -> RequestSpec:
    body: dict[str, Any] = {"model": model}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
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


# Generations cut into legs, and the answer the full path (parse, shape, dump) sends for them.
Legs = list[tuple[bool, list[dict[str, Any]]]]


def full_path(spec: RequestSpec, legs: Legs) -> tuple[ResponseShaper, bytes]:
    sh = ResponseShaper(spec)
    out = []
    for is_resume, chunks in legs:
        sh.begin_leg(is_resume=is_resume)
        for c in chunks:
            out += [format_event(x) for x in sh.shape(orjson.loads(orjson.dumps(c)))]
    out += [format_event(x) for x in sh.final_chunks()]
    return sh, b"".join(out)


def same_answer(a: ResponseShaper, b: ResponseShaper) -> None:
    assert list(a.answer.generated_token_ids) == list(b.answer.generated_token_ids)
    assert a.answer.generated_text == b.answer.generated_text
    assert a.answer.finish_reason == b.answer.finish_reason
    assert a.answer.leg_tokens == b.answer.leg_tokens
    assert a.answer.first_token_seen == b.answer.first_token_seen
    assert a.answer.token_ids_complete == b.answer.token_ids_complete
    assert a.emitted == b.emitted


texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)


@st.composite
def generations(draw: st.DrawFn) -> tuple[RequestSpec, Legs]:
    endpoint = draw(st.sampled_from([ENDPOINT_COMPLETIONS, ENDPOINT_CHAT]))
    stream = draw(st.booleans())
    spec = make_spec(
        endpoint,
        stream=stream,
        include_usage=stream and draw(st.booleans()),
        return_token_ids=draw(st.booleans()),
        continuous=stream and draw(st.booleans()),
    )
    steps = [
        Step(draw(texts), draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=2)))  # <= 16: the budget
        for _ in range(draw(st.integers(1, 8)))
    ]
    steps[-1].finish_reason = draw(st.sampled_from(["stop", "length"]))
    g = Gen(PROMPT, steps, cached_tokens=0, system_fingerprint=draw(st.sampled_from([None, "fp"])))
    n_legs = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, len(steps) - 1), min_size=n_legs - 1, max_size=n_legs - 1)))
    return spec, split_legs(endpoint, g, cuts, [False] * n_legs, [0] * n_legs)


def same_as_full_path(spec: RequestSpec, legs: Legs, fast: ResponseShaper, got: bytes) -> None:
    """A byte path drove `fast` and sent `got`: the bytes, the answer kept and a whole
    answer's body are the full path's."""
    full, want = full_path(spec, legs)
    assert got == want
    same_answer(full, fast)
    if not spec.stream:  # the body a non-streaming client gets
        assert fast.accumulate_response() == full.accumulate_response()
