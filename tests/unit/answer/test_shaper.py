"""The shaper (router/answer/shaper.py): whatever legs an answer took, a streaming client
receives exactly the stream one engine would have sent for the client's request, and a
non-streaming client exactly the body, except for ids and timestamps, which the shaper keeps
stable on its own values. The reference is vLLM 0.32's serving layer (support/vllm_serving.py
transcribes it); the real captures are in test_shaper_captures.py."""

from __future__ import annotations

import copy
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, RequestSpec
from router.answer.shaper import ResponseShaper
from router.engine.wire import MalformedChunk
from support.shaping import PROMPT, client_view, expected_cached, make_spec, run_legs, split_legs, steps_for
from support.vllm_serving import (
    Gen,
    Step,
    chat_full,
    chat_stream,
    completion_full,
    completion_stream,
)


def test_completions_stream_one_leg_matches_vllm() -> None:
    spec = make_spec(ENDPOINT_COMPLETIONS, include_usage=True)
    g = Gen(PROMPT, steps_for(3), cached_tokens=2, system_fingerprint="fp")
    sh, out = run_legs(spec, [(False, completion_stream(g))])
    assert out == completion_stream(client_view(spec, g))
    assert {c["id"] for c in out} == {spec.request_id}
    assert {c["model"] for c in out} == {"client-model"}
    assert list(sh.answer.generated_token_ids) == [1000, 1001, 1002]
    assert sh.answer.generated_text == "t0t1t2"
    assert sh.answer.prompt_token_ids == PROMPT
    assert sh.answer.finish_reason == "length"
    assert sh.answer.leg_tokens == 3
    assert sh.answer.first_token_seen
    assert sh.emitted


def test_chat_stream_one_leg_matches_vllm() -> None:
    spec = make_spec(ENDPOINT_CHAT, include_usage=True, return_token_ids=True)
    g = Gen(PROMPT, steps_for(3, finish="stop"), cached_tokens=0)
    _sh, out = run_legs(spec, [(False, chat_stream(g))])
    assert out == chat_stream(client_view(spec, g))
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert out[0]["prompt_token_ids"] == PROMPT


def test_token_ids_stripped_as_vllm_does_without_return_token_ids() -> None:
    spec = make_spec(ENDPOINT_CHAT)
    g = Gen(PROMPT, steps_for(2))
    _, out = run_legs(spec, [(False, chat_stream(g))])
    assert out[0]["prompt_token_ids"] is None
    assert all(c["choices"][0]["token_ids"] is None for c in out[1:])
    assert out == chat_stream(client_view(spec, g))  # no usage chunk: not asked


# A generation cut into legs: (spec, generation, cuts, finish_on_last, cached per leg).
Scenario = tuple[RequestSpec, Gen, list[int], list[bool], list[int | None]]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    endpoint = draw(st.sampled_from([ENDPOINT_COMPLETIONS, ENDPOINT_CHAT]))
    stream = draw(st.booleans())
    spec = make_spec(
        endpoint,
        stream=stream,
        include_usage=stream and draw(st.booleans()),
        return_token_ids=draw(st.booleans()),
        logprobs=draw(st.sampled_from([None, 0, 2])),
    )
    lp = spec.body.get("top_logprobs") if endpoint == ENDPOINT_CHAT else spec.body.get("logprobs")
    n_tokens = draw(st.integers(0, 8))
    steps = steps_for(
        n_tokens,
        finish=draw(st.sampled_from(["stop", "length"])),
        logprobs=lp is not None,
        per_step=draw(st.integers(1, 3)),
    )
    if not steps:
        steps = [Step("", [], "stop", logprobs=[] if lp is not None else None)]
    n_legs = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, len(steps) - 1), min_size=n_legs - 1, max_size=n_legs - 1)))
    finish_on_last = draw(st.lists(st.booleans(), min_size=n_legs, max_size=n_legs))
    cached = draw(st.lists(st.one_of(st.none(), st.integers(0, 12)), min_size=n_legs, max_size=n_legs))
    # --enable-prompt-tokens-details is engine-wide: all legs report it or none does.
    cached = [None] * n_legs if cached[0] is None else [c if c is not None else 0 for c in cached]
    return (
        spec,
        Gen(PROMPT, steps, logprobs=lp, system_fingerprint=draw(st.sampled_from([None, "fp"]))),
        cuts,
        finish_on_last,
        cached,
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_any_legs_read_as_one_answer(scenario: Scenario) -> None:
    spec, g, cuts, finish_on_last, cached = scenario
    legs = split_legs(spec.endpoint, g, cuts, finish_on_last, cached)
    sh, out = run_legs(spec, legs)
    want = client_view(spec, g)
    want.cached_tokens = expected_cached(g.steps, cuts, cached)
    if spec.endpoint == ENDPOINT_CHAT:
        expect_stream, expect_full = chat_stream(want), chat_full(want)
    else:
        expect_stream, expect_full = completion_stream(want), completion_full(want)
    if spec.stream:
        assert out == expect_stream
    else:
        assert sh.accumulate_response() == expect_full
    assert list(sh.answer.generated_token_ids) == [t for s in g.steps for t in s.token_ids]
    assert sh.answer.generated_text == "".join(s.text for s in g.steps)
    assert sh.answer.prompt_token_ids == PROMPT
    assert sh.answer.finish_reason == g.steps[-1].finish_reason


def test_chat_resumed_through_completion_leg_reads_as_one_chat_stream() -> None:
    spec = make_spec(ENDPOINT_CHAT, include_usage=True, return_token_ids=True, logprobs=2)
    g = Gen(PROMPT, steps_for(4, finish="stop", logprobs=True), cached_tokens=4, logprobs=2)
    legs = split_legs(ENDPOINT_CHAT, g, [2], [False, False], [4, 6])
    assert legs[1][1][0]["object"] == "text_completion"
    _, out = run_legs(spec, legs)
    assert out == chat_stream(client_view(spec, g))
    assert sum(1 for c in out if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
    assert out[-1]["usage"] == {
        "prompt_tokens": 4,
        "total_tokens": 8,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_rejected_first_leg_then_resume_keeps_role_and_prompt_usage() -> None:
    # The first leg is rejected with nothing generated (role chunk sent, finish held); the
    # answer then comes from a resume leg.
    spec = make_spec(ENDPOINT_CHAT, include_usage=True, return_token_ids=True)
    g = Gen(PROMPT, steps_for(2, finish="stop"), cached_tokens=0)
    legs = split_legs(ENDPOINT_CHAT, g, [0], [False], [1, 3])
    _sh, out = run_legs(spec, legs)
    want = client_view(spec, g)
    want.cached_tokens = 3
    assert out == chat_stream(want)


def test_retry_leg_role_chunk_not_sent_twice() -> None:
    spec = make_spec(ENDPOINT_CHAT)
    sh = ResponseShaper(spec)
    g = Gen(PROMPT, steps_for(1, finish="stop"), include_usage=False)
    sh.begin_leg(is_resume=False)
    first = sh.shape(chat_stream(g)[0])  # role chunk, then the leg breaks
    sh.begin_leg(is_resume=False)  # retry elsewhere
    rest = [c for ch in chat_stream(g) for c in sh.shape(ch)] + sh.final_chunks()
    assert len(first) == 1
    assert len(rest) == 1
    assert "role" not in rest[0]["choices"][0]["delta"]


def test_model_falls_back_to_the_first_legs() -> None:
    spec = make_spec(ENDPOINT_COMPLETIONS)
    spec = RequestSpec(**{**{f: getattr(spec, f) for f in spec.__slots__}, "model": None})
    _sh, out = run_legs(spec, [(False, completion_stream(Gen(PROMPT, steps_for(1))))])
    assert out[0]["model"] == "tiny"


def test_fingerprint_on_the_finish_chunk_without_usage_and_on_usage_chunk_with_it() -> None:
    g = Gen(PROMPT, steps_for(2), system_fingerprint="fp-1")
    for include_usage in (False, True):
        spec = make_spec(ENDPOINT_CHAT, include_usage=include_usage)
        _, out = run_legs(spec, [(False, chat_stream(g))])
        stamped = [i for i, c in enumerate(out) if "system_fingerprint" in c]
        assert stamped == [len(out) - 1]
        assert out == chat_stream(client_view(spec, g))


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=6,
)


def _field(key: str, good: Any) -> st.SearchStrategy[tuple[str, Any]]:
    return st.one_of(st.just(good), _json).map(lambda v: (key, v))


@st.composite
def odd_chunks(draw: st.DrawFn) -> dict[str, Any]:
    g = Gen(PROMPT, steps_for(2, logprobs=True, per_step=2), logprobs=2, cached_tokens=1)
    base: dict[str, Any] = copy.deepcopy(draw(st.sampled_from(chat_stream(g) + completion_stream(g))))
    if base["choices"] and draw(st.booleans()):
        c = base["choices"][0]
        key = draw(st.sampled_from([*sorted(c), "delta.content", "delta.tool_calls", "logprobs.tokens"]))
        value = draw(_json)
        if "." in key:
            outer, inner = key.split(".")
            if isinstance(c.get(outer), dict):
                c[outer][inner] = value
        else:
            c[key] = value
    if draw(st.booleans()):
        base[draw(st.sampled_from(sorted(base)))] = draw(_json)
    return base


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([ENDPOINT_CHAT, ENDPOINT_COMPLETIONS]),
    st.booleans(),
    st.lists(st.tuples(st.sampled_from([None, False, True]), odd_chunks()), max_size=8),
)
def test_odd_upstream_chunks_never_crash_the_shaper(
    endpoint: str, stream: bool, script: list[tuple[bool | None, dict[str, Any]]]
) -> None:
    spec = make_spec(endpoint, stream=stream, include_usage=stream, return_token_ids=True, logprobs=2)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for new_leg, chunk in script:
        if new_leg is not None:
            sh.begin_leg(is_resume=new_leg)
        try:
            out = sh.shape(chunk)
        except MalformedChunk:
            continue
        orjson.dumps(out)
    orjson.dumps(sh.release_held() + sh.final_chunks())
    orjson.dumps(sh.accumulate_response())
    assert all(type(t) is int for t in sh.answer.generated_token_ids)
    assert isinstance(sh.answer.generated_text, str)
