"""ResponseShaper and is_rejection_chunk.

The reference is vLLM 0.32's serving layer (tests/router_unit/vllm_shapes.py transcribes
it): whatever legs an answer took, a streaming client must receive exactly the stream one
engine would have sent for the client's request, and a non-streaming client exactly the
body, except for ids and timestamps, which the shaper keeps stable on its own values.
"""

from __future__ import annotations

import copy

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, RequestSpec, parse_request
from router.answer.shaper import ResponseShaper
from router.engine.wire import CACHE_THRESHOLD, MalformedChunk, is_rejection_chunk
from support.vllm_serving import (
    Gen,
    Step,
    _chat_logprobs,
    _completion_logprobs,
    chat_full,
    chat_stream,
    completion_full,
    completion_stream,
)
from support.wire_captures import body, normalized, request_body, stream_chunks

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
    body: dict = {"model": model}
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
    spec: RequestSpec, legs: list[tuple[bool, list[dict]]], *, release: bool = False
) -> tuple[ResponseShaper, list[dict]]:
    sh = ResponseShaper(spec)
    out: list[dict] = []
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


# --- is_rejection_chunk ---------------------------------------------------------------------


def test_is_rejection_chunk():
    g = Gen(PROMPT, steps_for(2))
    role, first = chat_stream(g)[:2]
    usage = chat_stream(g)[-1]
    assert is_rejection_chunk(role) is None
    assert is_rejection_chunk(usage) is None
    assert is_rejection_chunk({}) is None
    assert is_rejection_chunk(first) is False
    assert is_rejection_chunk(completion_stream(g)[0]) is False
    rej = Gen(PROMPT, [Step("", [], CACHE_THRESHOLD)])
    assert is_rejection_chunk(chat_stream(rej)[1]) is True
    assert is_rejection_chunk(completion_stream(rej)[0]) is True
    # Another finish with nothing generated is an answer (e.g. max_tokens reached at once).
    assert is_rejection_chunk(completion_stream(Gen(PROMPT, [Step("", [], "stop")]))[0]) is False
    # cache_threshold with tokens in the same chunk: accepted (the leg produced output).
    assert is_rejection_chunk(completion_stream(Gen(PROMPT, [Step("a", [5], CACHE_THRESHOLD)]))[0]) is False
    assert (
        is_rejection_chunk(
            {"choices": [{"index": 0, "delta": {"reasoning": "hm"}, "finish_reason": None, "token_ids": None}]}
        )
        is False
    )
    # The chunk vLLM sends for chat `echo` right after the role chunk, before any decision
    # (no token_ids key, like the role chunk): undecided, though it has text.
    echo = {
        "choices": [{"index": 0, "delta": {"content": "the last message"}, "logprobs": None, "finish_reason": None}]
    }
    assert is_rejection_chunk(echo) is None
    # A byte-level token whose text comes later: token ids decide.
    assert (
        is_rejection_chunk(
            {
                "choices": [
                    {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None, "token_ids": [7]}
                ]
            }
        )
        is False
    )
    assert is_rejection_chunk({"choices": ["junk"]}) is None


# --- one leg: the client sees what one engine would have sent --------------------------------------


def test_completions_stream_one_leg_matches_vllm():
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


def test_chat_stream_one_leg_matches_vllm():
    spec = make_spec(ENDPOINT_CHAT, include_usage=True, return_token_ids=True)
    g = Gen(PROMPT, steps_for(3, finish="stop"), cached_tokens=0)
    _sh, out = run_legs(spec, [(False, chat_stream(g))])
    assert out == chat_stream(client_view(spec, g))
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert out[0]["prompt_token_ids"] == PROMPT


def test_token_ids_stripped_as_vllm_does_without_return_token_ids():
    spec = make_spec(ENDPOINT_CHAT)
    g = Gen(PROMPT, steps_for(2))
    _, out = run_legs(spec, [(False, chat_stream(g))])
    assert out[0]["prompt_token_ids"] is None
    assert all(c["choices"][0]["token_ids"] is None for c in out[1:])
    assert out == chat_stream(client_view(spec, g))  # no usage chunk: not asked


def test_non_streaming_one_leg_equals_vllm_body():
    for endpoint, full, stream in (
        (ENDPOINT_COMPLETIONS, completion_full, completion_stream),
        (ENDPOINT_CHAT, chat_full, chat_stream),
    ):
        for rti in (False, True):
            spec = make_spec(endpoint, stream=False, return_token_ids=rti, logprobs=2)
            g = Gen(
                PROMPT, steps_for(4, logprobs=True, per_step=2), cached_tokens=3, logprobs=2, system_fingerprint="fp"
            )
            sh, _ = run_legs(spec, [(False, stream(g))])
            assert sh.accumulate_response() == full(client_view(spec, g))


def test_continuous_usage_stats():
    spec = make_spec(ENDPOINT_COMPLETIONS, include_usage=True, continuous=True)
    _, out = run_legs(spec, [(False, completion_stream(Gen(PROMPT, steps_for(3))))])
    assert [c["usage"]["completion_tokens"] for c in out] == [1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == 4 for c in out)


# --- several legs ----------------------------------------------------------------------------


def split_legs(
    endpoint: str, g: Gen, cuts: list[int], finish_on_last: list[bool], cached: list[int | None]
) -> list[tuple[bool, list[dict]]]:
    """Upstream legs for generation `g` interrupted after the given numbers of steps:
    every leg but the last ends in cache_threshold (on its last content chunk or in a
    chunk of its own); resume legs are completion streams with prompt + generated ids."""
    bounds = [0, *cuts, len(g.steps)]
    legs = []
    generated: list[int] = []
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
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
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if cached[n] is None:
            continue
        if any(s.token_ids for s in g_steps[a:b]):
            return min(cached[n], len(PROMPT))
        if first_reported is None:
            first_reported = min(cached[n], len(PROMPT))
    return first_reported


@st.composite
def scenarios(draw):
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
    if cached[0] is None:
        cached = [None] * n_legs
    else:
        cached = [c if c is not None else 0 for c in cached]
    return (
        spec,
        Gen(PROMPT, steps, logprobs=lp, system_fingerprint=draw(st.sampled_from([None, "fp"]))),
        cuts,
        finish_on_last,
        cached,
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_any_legs_read_as_one_answer(scenario):
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


def test_chat_resumed_through_completion_leg_reads_as_one_chat_stream():
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


def test_completion_text_offsets_continue_across_legs():
    spec = make_spec(ENDPOINT_COMPLETIONS, logprobs=1)
    g = Gen(PROMPT, steps_for(3, logprobs=True), logprobs=1)
    legs = split_legs(ENDPOINT_COMPLETIONS, g, [1, 2], [True, False], [None, None, None])
    _, out = run_legs(spec, legs)
    offsets = [o for c in out if c["choices"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 2, 4]


# --- the held cache_threshold finish ------------------------------------------------------------


def test_cache_threshold_finish_is_held_until_released():
    spec = make_spec(ENDPOINT_COMPLETIONS, include_usage=True)
    g = Gen(PROMPT, [*steps_for(2), Step("", [], CACHE_THRESHOLD)])
    g.steps[1].finish_reason = None
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    chunks = completion_stream(g)
    shaped = [sh.shape(c) for c in chunks]
    assert [len(s) for s in shaped] == [1, 1, 0, 0]  # the finish and the usage chunk are kept
    assert sh.answer.finish_reason == CACHE_THRESHOLD
    assert sh.answer.leg_tokens == 2
    held = sh.release_held()
    assert len(held) == 1
    assert held[0]["choices"][0]["finish_reason"] == CACHE_THRESHOLD
    assert held[0]["id"] == spec.request_id
    assert sh.release_held() == []
    final = sh.final_chunks()
    assert len(final) == 1
    assert final[0]["usage"]["completion_tokens"] == 2


def test_final_chunks_release_a_still_held_finish():
    spec = make_spec(ENDPOINT_CHAT)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for c in chat_stream(Gen(PROMPT, [Step("a", [1]), Step("", [], CACHE_THRESHOLD)], include_usage=False)):
        sh.shape(c)
    final = sh.final_chunks()
    assert [c["choices"][0]["finish_reason"] for c in final] == [CACHE_THRESHOLD]


def test_finish_with_content_is_split():
    spec = make_spec(ENDPOINT_CHAT, return_token_ids=True)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    chunks = chat_stream(Gen(PROMPT, [Step("ab", [1, 2], CACHE_THRESHOLD, stop_reason=None)], include_usage=False))
    out = [c for ch in chunks for c in sh.shape(ch)]
    assert out[-1]["choices"][0] == {
        "index": 0,
        "delta": {"content": "ab"},
        "logprobs": None,
        "finish_reason": None,
        "token_ids": [1, 2],
    }
    (held,) = sh.release_held()
    assert held["choices"][0] == {
        "index": 0,
        "delta": {"content": ""},
        "logprobs": None,
        "finish_reason": CACHE_THRESHOLD,
        "stop_reason": None,
        "token_ids": [],
    }


def test_rejected_first_leg_then_resume_keeps_role_and_prompt_usage():
    # The first leg is rejected with nothing generated (role chunk sent, finish held); the
    # answer then comes from a resume leg.
    spec = make_spec(ENDPOINT_CHAT, include_usage=True, return_token_ids=True)
    g = Gen(PROMPT, steps_for(2, finish="stop"), cached_tokens=0)
    legs = split_legs(ENDPOINT_CHAT, g, [0], [False], [1, 3])
    _sh, out = run_legs(spec, legs)
    want = client_view(spec, g)
    want.cached_tokens = 3
    assert out == chat_stream(want)


def test_retry_leg_role_chunk_not_sent_twice():
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


def test_model_falls_back_to_the_first_legs():
    spec = make_spec(ENDPOINT_COMPLETIONS)
    spec = RequestSpec(**{**{f: getattr(spec, f) for f in spec.__slots__}, "model": None})
    _sh, out = run_legs(spec, [(False, completion_stream(Gen(PROMPT, steps_for(1))))])
    assert out[0]["model"] == "tiny"


def test_content_of_a_dropped_finish_chunk_still_reaches_the_client():
    # A leg sends its last content together with a normal finish, then breaks before
    # [DONE]; the lead resumes. The content must reach the client, the finish must not.
    spec = make_spec(ENDPOINT_COMPLETIONS)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    out = [
        c
        for ch in completion_stream(Gen(PROMPT, [Step("a", [1]), Step("b", [2], "length")], include_usage=False))
        for c in sh.shape(ch)
    ]
    assert [c["choices"][0]["text"] for c in out] == ["a"]
    sh.begin_leg(is_resume=True)
    out += [
        c
        for ch in completion_stream(Gen([*PROMPT, 1, 2], [Step("c", [3], "stop")], include_usage=False))
        for c in sh.shape(ch)
    ]
    out += sh.final_chunks()
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in out] == [
        ("a", None),
        ("b", None),
        ("c", "stop"),
    ]
    assert list(sh.answer.generated_token_ids) == [1, 2, 3]


def test_pending_content_flushed_by_final_chunks_when_no_leg_follows():
    spec = make_spec(ENDPOINT_CHAT)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for ch in chat_stream(Gen(PROMPT, [Step("a", [1], "stop")], include_usage=False)):
        sh.shape(ch)
    sh.begin_leg(is_resume=True)
    out = sh.final_chunks()
    assert [c["choices"][0]["delta"] for c in out] == [{"content": "a"}]
    assert out[0]["choices"][0]["finish_reason"] is None


def test_fingerprint_on_the_finish_chunk_without_usage_and_on_usage_chunk_with_it():
    g = Gen(PROMPT, steps_for(2), system_fingerprint="fp-1")
    for include_usage in (False, True):
        spec = make_spec(ENDPOINT_CHAT, include_usage=include_usage)
        _, out = run_legs(spec, [(False, chat_stream(g))])
        stamped = [i for i, c in enumerate(out) if "system_fingerprint" in c]
        assert stamped == [len(out) - 1]
        assert out == chat_stream(client_view(spec, g))


# --- against real vLLM 0.32 captures (tests/fixtures/vllm_wire, docs/VLLM_WIRE.md) ----------------

# (upstream stream as the router's legs ask for it, client request whose real answer we have)
WIRE_CASES = [
    ("completions_stream_usage_token_ids", "completions_stream"),
    ("completions_stream_usage_token_ids", "completions_stream_usage"),
    ("completions_stream_usage_token_ids", "completions_stream_usage_token_ids"),
    ("completions_stream_usage_token_ids", "completions"),
    ("completions_stream_usage_token_ids", "completions_token_ids"),
    ("completions_stream_logprobs", "completions_logprobs"),
    ("completions_stream_logprobs", "completions_stream_logprobs"),
    ("model_specific/completions_stream_stop_string", "model_specific/completions_stop_string"),
    ("model_specific/completions_stream_stop_string", "model_specific/completions_stream_stop_string"),
    ("model_specific/completions_stream_stop_token", "model_specific/completions_stop_token"),
    ("model_specific/completions_stream_stop_token", "model_specific/completions_stream_stop_token"),
    ("chat_stream_usage_token_ids", "chat_stream"),
    ("chat_stream_usage_token_ids", "chat_stream_usage"),
    ("chat_stream_usage_token_ids", "chat_stream_usage_token_ids"),
    ("chat_stream_usage_token_ids", "chat"),
    ("chat_stream_usage_token_ids", "chat_token_ids"),
    ("chat_stream_logprobs", "chat_logprobs"),
    ("chat_stream_logprobs", "chat_stream_logprobs"),
]


def _endpoint(name: str) -> str:
    return ENDPOINT_CHAT if "chat" in name else ENDPOINT_COMPLETIONS


def _run_one_leg(upstream: list[dict], spec: RequestSpec) -> tuple[ResponseShaper, list[dict]]:
    return run_legs(spec, [(False, upstream)])


@pytest.mark.parametrize(("upstream", "client"), WIRE_CASES)
def test_real_capture_one_leg(upstream, client):
    spec = parse_request(_endpoint(client), request_body(client))
    sh, out = _run_one_leg(stream_chunks(upstream), spec)
    if spec.stream:
        assert normalized(out) == normalized(stream_chunks(client))
        # Byte-for-byte too (vLLM writes compact JSON in the same key order).
        want = [orjson.dumps(c) for c in normalized(stream_chunks(client))]
        assert [orjson.dumps(c) for c in normalized(out)] == want
        assert {c["id"] for c in out} == {spec.request_id}
    else:
        resp = sh.accumulate_response()
        assert normalized(resp) == normalized(body(client))
        assert orjson.dumps(normalized(resp)) == orjson.dumps(normalized(body(client)))


def test_real_capture_continuous_usage_numbers():
    client = "completions_stream_continuous_usage"  # max_tokens 2
    spec = parse_request(ENDPOINT_COMPLETIONS, request_body(client))
    _, out = _run_one_leg(stream_chunks("completions_stream_logprobs"), spec)  # same 2 tokens
    assert [c.get("usage") for c in out] == [c.get("usage") for c in stream_chunks(client)]
    assert [c["choices"][0]["text"] for c in out if c["choices"]] == [
        c["choices"][0]["text"] for c in stream_chunks(client) if c["choices"]
    ]


def test_real_capture_verdicts():
    chat = stream_chunks("chat_stream_usage_token_ids")
    assert [is_rejection_chunk(c) for c in chat] == [None, False, False, False, False, None]
    cmpl = stream_chunks("disagg_decode_leg_stream")
    assert is_rejection_chunk(cmpl[0]) is False
    assert is_rejection_chunk(cmpl[-1]) is None


def _as_resume_leg(chat_chunks: list[dict], prompt: list[int], generated: list[int]) -> list[dict]:
    """Real chat token chunks re-expressed as the /v1/completions stream a resume leg gets
    (same text and ids, completion chunk shape from the real captures)."""
    out = []
    for i, c in enumerate(chat_chunks):
        ch = c["choices"][0]
        out.append(
            {
                "id": "cmpl-<id>",
                "object": "text_completion",
                "created": 1700000001,
                "model": "tiny",
                "choices": [
                    {
                        "index": 0,
                        "text": ch["delta"]["content"],
                        "logprobs": None,
                        "finish_reason": ch["finish_reason"],
                        "stop_reason": ch.get("stop_reason"),
                        "prompt_token_ids": prompt + generated if i == 0 else None,
                        "token_ids": ch["token_ids"],
                    }
                ],
            }
        )
    n = sum(len(c["choices"][0]["token_ids"]) for c in chat_chunks)
    out.append(
        {
            "id": "cmpl-<id>",
            "object": "text_completion",
            "created": 1700000001,
            "model": "tiny",
            "choices": [],
            "usage": {
                "prompt_tokens": len(prompt) + len(generated),
                "total_tokens": len(prompt) + len(generated) + n,
                "completion_tokens": n,
            },
            "system_fingerprint": "vllm-0.32.0-<fingerprint>",
        }
    )
    return out


@pytest.mark.parametrize("client", ["chat_stream", "chat_stream_usage_token_ids", "chat", "chat_token_ids"])
def test_real_chat_answer_preempted_and_resumed_reads_as_the_real_answer(client):
    # The real stream, cut after two tokens by a preemption (the plugin's finishing chunk:
    # delta content "", token_ids [], cache_threshold; then usage), continued by a resume leg.
    real = stream_chunks("chat_stream_usage_token_ids")
    role, tokens, usage = real[0], real[1:-1], real[-1]
    prompt = role["prompt_token_ids"]
    first, rest = tokens[:2], tokens[2:]
    generated = [t for c in first for t in c["choices"][0]["token_ids"]]
    preempt = {
        **first[0],
        "choices": [
            {
                "index": 0,
                "delta": {"content": ""},
                "logprobs": None,
                "finish_reason": CACHE_THRESHOLD,
                "stop_reason": None,
                "token_ids": [],
            }
        ],
    }
    leg1 = [
        role,
        *copy.deepcopy(first),
        preempt,
        {**usage, "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + 2, "completion_tokens": 2}},
    ]
    leg2 = _as_resume_leg(copy.deepcopy(rest), prompt, generated)
    spec = parse_request(ENDPOINT_CHAT, request_body(client))
    sh, out = run_legs(spec, [(False, leg1), (True, leg2)])
    if spec.stream:
        assert normalized(out) == normalized(stream_chunks(client))
    else:
        assert normalized(sh.accumulate_response()) == normalized(body(client))
    assert list(sh.answer.generated_token_ids) == [t for c in tokens for t in c["choices"][0]["token_ids"]]


THRESHOLD_STREAMS = {
    "threshold_chat_stream_rejected": ("threshold_chat_rejected", [None, True, None]),
    "threshold_completions_stream_rejected": ("threshold_completions_rejected", [True, None]),
}


@pytest.mark.parametrize("stream_name", sorted(THRESHOLD_STREAMS))
def test_real_threshold_rejection_captures(stream_name):
    """Plugin captures (capture_wire.py --plugin) of a rejected request, streamed exactly as
    the router's probe legs ask (stream, usage, token ids, threshold)."""
    body_name, verdicts = THRESHOLD_STREAMS[stream_name]
    chunks = stream_chunks(stream_name)
    # The role chunk decides nothing, the cache_threshold finish with no token rejects.
    assert [is_rejection_chunk(c) for c in chunks] == verdicts

    # Ending an answer with that rejection (the lead releases the held finish) gives the
    # client exactly the engine's stream for the same request.
    spec = parse_request(_endpoint(stream_name), request_body(stream_name))
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    out = [c for ch in stream_chunks(stream_name) for c in sh.shape(ch)]
    assert all(c["choices"][0]["finish_reason"] is None for c in out)  # the finish is held
    assert sh.answer.finish_reason == CACHE_THRESHOLD
    assert sh.answer.leg_tokens == 0
    assert not sh.answer.generated_token_ids
    out += sh.release_held() + sh.final_chunks()
    assert orjson.dumps(normalized(out)) == orjson.dumps(normalized(chunks))

    # A non-streaming client gets the engine's non-streaming body. The two captures used
    # different prompts, so the prompt's ids and count come from the stream.
    spec = parse_request(_endpoint(body_name), request_body(body_name))
    sh, _ = run_legs(spec, [(False, stream_chunks(stream_name))])
    want = body(body_name)
    usage = chunks[-1]["usage"]
    want["usage"].update(prompt_tokens=usage["prompt_tokens"], total_tokens=usage["total_tokens"])
    prompt_ids = (
        chunks[0]["prompt_token_ids"]
        if "prompt_token_ids" in chunks[0]
        else chunks[0]["choices"][0]["prompt_token_ids"]
    )
    if spec.endpoint == ENDPOINT_CHAT:
        want["prompt_token_ids"] = prompt_ids
    else:
        want["choices"][0]["prompt_token_ids"] = prompt_ids
    assert orjson.dumps(normalized(sh.accumulate_response())) == orjson.dumps(normalized(want))


def test_real_threshold_error_captures_are_not_router_errors():
    # The router owns the threshold: out-of-range client values that the plugin answers with
    # a 400 are stripped at admission instead (documented in router/admission/spec.py).
    for name in ("threshold_error_out_of_range", "threshold_error_out_of_range_xargs"):
        spec = parse_request(ENDPOINT_COMPLETIONS, request_body(name))
        assert "cache_hit_threshold" not in spec.body
        assert "cache_hit_threshold" not in (spec.body.get("vllm_xargs") or {})


# --- chat parsers' deltas (reasoning, tool calls) and robustness ------------------------------------


def _chat_chunk(delta: dict, finish: str | None = None, ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = ids or []
    return {"id": "chatcmpl-e", "object": "chat.completion.chunk", "created": 1, "model": "tiny", "choices": [choice]}


def test_non_streaming_chat_merges_reasoning_and_tool_call_deltas():
    spec = make_spec(ENDPOINT_CHAT, stream=False)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    role = chat_stream(Gen(PROMPT, []))[0]
    chunks = [
        role,
        _chat_chunk({"reasoning": "think "}, ids=[1]),
        _chat_chunk({"reasoning": "more"}, ids=[2]),
        _chat_chunk(
            {
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-1",
                        "type": "function",
                        "index": 0,
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            },
            ids=[3],
        ),
        _chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, ids=[4]),
        _chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, ids=[5]),
        _chat_chunk({}, finish="tool_calls", ids=[6]),
    ]
    for c in chunks:
        assert sh.shape(c) == []  # nothing is built for a non-streaming client
    assert not sh.emitted
    assert sh.answer.first_token_seen
    msg = sh.accumulate_response()["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    assert msg["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
        "reasoning": "think more",
    }
    assert list(sh.answer.generated_token_ids) == [1, 2, 3, 4, 5, 6]


def test_reasoning_then_content():
    spec = make_spec(ENDPOINT_CHAT, stream=False)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for c in [
        chat_stream(Gen(PROMPT, []))[0],
        _chat_chunk({"reasoning": "r"}, ids=[1]),
        _chat_chunk({"content": "answer"}, ids=[2]),
        _chat_chunk({"content": ""}, finish="stop", ids=[3]),
    ]:
        sh.shape(c)
    m = sh.accumulate_response()["choices"][0]["message"]
    assert (m["content"], m["reasoning"]) == ("answer", "r")
    assert "tool_calls" not in m


def test_zero_token_answer_has_empty_content():
    spec = make_spec(ENDPOINT_CHAT, stream=False)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for c in chat_stream(Gen(PROMPT, [Step("", [], "stop")])):
        sh.shape(c)
    r = sh.accumulate_response()
    assert r["choices"][0]["message"]["content"] == ""
    assert r["usage"]["completion_tokens"] == 0


def test_odd_top_logprobs_does_not_break_the_shaper():
    spec = parse_request(
        ENDPOINT_CHAT,
        orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": "many"}
        ),
    )
    assert spec.body["top_logprobs"] == "many"  # admission leaves it to the engine to reject
    ResponseShaper(spec)  # constructing must not raise


def test_lead_state_after_a_preempted_leg():
    spec = make_spec(ENDPOINT_COMPLETIONS)
    g = Gen(PROMPT, steps_for(3, finish="stop"))
    legs = split_legs(ENDPOINT_COMPLETIONS, g, [2], [False, False], [None, None])
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for c in legs[0][1]:
        sh.shape(c)
    assert (
        sh.answer.finish_reason,
        sh.answer.leg_tokens,
        list(sh.answer.generated_token_ids),
        sh.answer.prompt_token_ids,
    ) == (CACHE_THRESHOLD, 2, [1000, 1001], PROMPT)
    sh.begin_leg(is_resume=True)
    assert (sh.answer.finish_reason, sh.answer.leg_tokens) == (None, 0)
    for c in legs[1][1]:
        sh.shape(c)
    assert (sh.answer.finish_reason, sh.answer.leg_tokens, len(sh.answer.generated_token_ids)) == ("stop", 1, 3)
    assert sh.answer.prompt_token_ids == PROMPT  # not the resume leg's prompt


# --- vllm_shapes against vLLM's own pydantic models (slow: importing vLLM takes seconds) ----------


@pytest.mark.slow
def test_vllm_shapes_transcription_matches_vllm_models():
    """The reference shapes used above, rebuilt with vLLM 0.32's own response classes and
    dumped the way its serving layer dumps them."""
    cp = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    ch = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    base = pytest.importorskip("vllm.entrypoints.generate.base.protocol")
    eng = pytest.importorskip("vllm.entrypoints.serve.engine.protocol")

    g = Gen(PROMPT, steps_for(2, finish="stop", logprobs=True), cached_tokens=1, logprobs=2, system_fingerprint="fp")
    steps = g.steps
    ids = [t for s in steps for t in s.token_ids]

    # completions, streaming chunks: model_dump_json(exclude_unset=True)
    lp0, _ = _completion_logprobs([steps[0]], 0)
    chunk = cp.CompletionStreamResponse(
        id=g.request_id,
        object="text_completion",
        created=g.created,
        model=g.model,
        choices=[
            cp.CompletionResponseStreamChoice(
                index=0,
                text=steps[0].text,
                logprobs=cp.CompletionLogProbs(**lp0),
                finish_reason=None,
                stop_reason=None,
                prompt_token_ids=PROMPT,
                token_ids=steps[0].token_ids,
            )
        ],
    )
    assert orjson.loads(chunk.model_dump_json(exclude_unset=True)) == completion_stream(g)[0]
    usage = eng.UsageInfo(prompt_tokens=4, completion_tokens=2, total_tokens=6)
    usage.prompt_tokens_details = eng.PromptTokenUsageInfo(cached_tokens=1)
    uchunk = cp.CompletionStreamResponse(
        id=g.request_id, created=g.created, model=g.model, choices=[], usage=usage, system_fingerprint="fp"
    )
    assert orjson.loads(uchunk.model_dump_json(exclude_unset=False, exclude_none=True)) == completion_stream(g)[-1]

    # completions, non-streaming: model_dump()
    lp_all, _ = _completion_logprobs(steps, 0)
    full = cp.CompletionResponse(
        id=g.request_id,
        created=g.created,
        model=g.model,
        usage=usage,
        system_fingerprint="fp",
        choices=[
            cp.CompletionResponseChoice(
                index=0,
                text="t0t1",
                logprobs=cp.CompletionLogProbs(**lp_all),
                finish_reason="stop",
                stop_reason=None,
                prompt_logprobs=None,
                prompt_token_ids=PROMPT,
                token_ids=ids,
                routed_experts=None,
            )
        ],
    )
    assert full.model_dump() == completion_full(g)

    # chat, streaming: role chunk, token chunk, finish chunk, usage chunk
    head = dict(id=g.request_id, object="chat.completion.chunk", created=g.created, model=g.model)
    role = ch.ChatCompletionStreamResponse(
        **head,
        choices=[
            ch.ChatCompletionResponseStreamChoice(
                index=0, delta=base.DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None
            )
        ],
        prompt_token_ids=PROMPT,
        prompt_text=None,
    )
    cs = chat_stream(g)
    assert orjson.loads(role.model_dump_json(exclude_unset=True)) == cs[0]
    clp = _chat_logprobs
    for k, s in enumerate(steps):
        kw = dict(
            index=0,
            delta=base.DeltaMessage(content=s.text),
            logprobs=ch.ChatCompletionLogProbs(**clp([s], 2)),
            finish_reason=s.finish_reason,
        )
        if s.finish_reason is not None:
            kw["stop_reason"] = s.stop_reason
        c = ch.ChatCompletionStreamResponse(
            **head, choices=[ch.ChatCompletionResponseStreamChoice(**kw, token_ids=s.token_ids)]
        )
        assert orjson.loads(c.model_dump_json(exclude_unset=True)) == cs[1 + k]
    cu = eng.UsageInfo(prompt_tokens=4, completion_tokens=2, total_tokens=6, completion_tokens_details=None)
    cu.prompt_tokens_details = eng.PromptTokenUsageInfo(cached_tokens=1)
    uc = ch.ChatCompletionStreamResponse(**head, choices=[], usage=cu, system_fingerprint="fp")
    assert orjson.loads(uc.model_dump_json(exclude_unset=True, exclude_none=True)) == cs[-1]

    # chat, non-streaming
    msg = ch.ChatMessage(role="assistant", reasoning=None, content="t0t1")
    cfull = ch.ChatCompletionResponse(
        id=g.request_id,
        created=g.created,
        model=g.model,
        usage=cu,
        system_fingerprint="fp",
        choices=[
            ch.ChatCompletionResponseChoice(
                index=0,
                message=msg,
                logprobs=ch.ChatCompletionLogProbs(**clp(steps, 2)),
                finish_reason="stop",
                stop_reason=None,
                token_ids=ids,
            )
        ],
        prompt_logprobs=None,
        prompt_token_ids=PROMPT,
        prompt_text=None,
    )
    assert cfull.model_dump() == chat_full(g)

    # chat continuous usage as the shaper writes it
    c = ch.ChatCompletionStreamResponse(**head, choices=[])
    c.usage = eng.UsageInfo(prompt_tokens=4, completion_tokens=1, total_tokens=5, completion_tokens_details=None)
    spec = make_spec(ENDPOINT_CHAT, include_usage=True, continuous=True)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    sh.shape(chat_stream(Gen(PROMPT, steps_for(2)))[0])
    (first,) = sh.shape(chat_stream(Gen(PROMPT, steps_for(2)))[1])
    assert first["usage"] == orjson.loads(c.model_dump_json(exclude_unset=True))["usage"]

    # a chat answer with reasoning and a tool call, non-streaming message
    m = ch.ChatMessage(
        role="assistant",
        reasoning="r",
        content=None,
        tool_calls=[base.ToolCall(id="call1", function=base.FunctionCall(name="f", arguments="{}"))],
    )
    sh = ResponseShaper(make_spec(ENDPOINT_CHAT, stream=False))
    sh.begin_leg(is_resume=False)
    for c in [
        chat_stream(Gen(PROMPT, []))[0],
        _chat_chunk({"reasoning": "r"}, ids=[1]),
        _chat_chunk(
            {
                "tool_calls": [
                    {"id": "call1", "type": "function", "index": 0, "function": {"name": "f", "arguments": "{"}}
                ]
            },
            ids=[2],
        ),
        _chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}, finish="tool_calls", ids=[3]),
    ]:
        sh.shape(c)
    assert sh.accumulate_response()["choices"][0]["message"] == m.model_dump()


# --- robustness: whatever an upstream sends, the shaper raises MalformedChunk or carries on -------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=6,
)


def _field(key: str, good):
    return st.one_of(st.just(good), _json).map(lambda v: (key, v))


@st.composite
def odd_chunks(draw):
    g = Gen(PROMPT, steps_for(2, logprobs=True, per_step=2), logprobs=2, cached_tokens=1)
    base = copy.deepcopy(draw(st.sampled_from(chat_stream(g) + completion_stream(g))))
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
def test_odd_upstream_chunks_never_crash_the_shaper(endpoint, stream, script):
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


def test_preemption_finish_flushing_held_back_text_goes_out_before_the_resume():
    # vLLM holds back text that may start a stop string and flushes it when the request
    # finishes: a cache_threshold finish can carry text with no new token ids.
    spec = make_spec(ENDPOINT_COMPLETIONS)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    leg1 = completion_stream(
        Gen(PROMPT, [Step("a", [1]), Step("", [2]), Step("bc", [], CACHE_THRESHOLD)], include_usage=False)
    )
    out = [c for ch in leg1 for c in sh.shape(ch)]
    assert "".join(c["choices"][0]["text"] for c in out) == "abc"
    assert all(c["choices"][0]["finish_reason"] is None for c in out)
    assert sh.answer.finish_reason == CACHE_THRESHOLD
    assert sh.answer.leg_tokens == 2
    sh.begin_leg(is_resume=True)  # the held finish is dropped
    leg2 = completion_stream(Gen([*PROMPT, 1, 2], [Step("d", [3], "stop")], include_usage=False))
    out += [c for ch in leg2 for c in sh.shape(ch)] + sh.final_chunks()
    assert "".join(c["choices"][0]["text"] for c in out) == "abcd"
    assert [c["choices"][0]["finish_reason"] for c in out][-1] == "stop"
    assert sum(1 for c in out if c["choices"][0]["finish_reason"]) == 1


def test_hidden_token_ids_make_the_answer_unresumable():
    spec = make_spec(ENDPOINT_CHAT)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    sh.shape(chat_stream(Gen(PROMPT, []))[0])
    assert sh.answer.token_ids_complete
    # vLLM with a reasoning parser and include_reasoning false: token_ids null in the chunks.
    sh.shape(
        {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "tiny",
            "choices": [
                {"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None, "token_ids": None}
            ],
        }
    )
    assert not sh.answer.token_ids_complete
    sh2 = ResponseShaper(spec)
    sh2.begin_leg(is_resume=False)
    for c in chat_stream(Gen(PROMPT, steps_for(2))):
        sh2.shape(c)
    assert sh2.answer.token_ids_complete
    assert sh2.answer.leg_tokens == 2
