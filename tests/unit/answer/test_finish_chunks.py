"""Finish chunks across legs (router/answer/finish_chunks.py): the cache_threshold finish
held until released, a finish carrying content split, content of a dropped finish kept."""

from __future__ import annotations

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS
from router.answer.shaper import ResponseShaper
from router.engine.wire import CACHE_THRESHOLD
from support.shaping import PROMPT, make_spec, steps_for
from support.vllm_serving import (
    Gen,
    Step,
    chat_stream,
    completion_stream,
)


def test_cache_threshold_finish_is_held_until_released() -> None:
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


def test_final_chunks_release_a_still_held_finish() -> None:
    spec = make_spec(ENDPOINT_CHAT)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for c in chat_stream(Gen(PROMPT, [Step("a", [1]), Step("", [], CACHE_THRESHOLD)], include_usage=False)):
        sh.shape(c)
    final = sh.final_chunks()
    assert [c["choices"][0]["finish_reason"] for c in final] == [CACHE_THRESHOLD]


def test_finish_with_content_is_split() -> None:
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


def test_content_of_a_dropped_finish_chunk_still_reaches_the_client() -> None:
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


def test_pending_content_flushed_by_final_chunks_when_no_leg_follows() -> None:
    spec = make_spec(ENDPOINT_CHAT)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for ch in chat_stream(Gen(PROMPT, [Step("a", [1], "stop")], include_usage=False)):
        sh.shape(ch)
    sh.begin_leg(is_resume=True)
    out = sh.final_chunks()
    assert [c["choices"][0]["delta"] for c in out] == [{"content": "a"}]
    assert out[0]["choices"][0]["finish_reason"] is None


def test_preemption_finish_flushing_held_back_text_goes_out_before_the_resume() -> None:
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
