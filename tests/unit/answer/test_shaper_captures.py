"""The shaper against real vLLM 0.32 captures (tests/fixtures/vllm_wire, docs/VLLM_WIRE.md):
one leg, a preempted and resumed chat answer, and the plugin's threshold rejections."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, RequestSpec, parse_request
from router.answer.shaper import ResponseShaper
from router.engine.wire import CACHE_THRESHOLD, is_rejection_chunk
from support.shaping import run_legs
from support.wire_captures import body, normalized, request_body, stream_chunks

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


def _run_one_leg(upstream: list[dict[str, Any]], spec: RequestSpec) -> tuple[ResponseShaper, list[dict[str, Any]]]:
    return run_legs(spec, [(False, upstream)])


@pytest.mark.parametrize(("upstream", "client"), WIRE_CASES)
def test_real_capture_one_leg(upstream: str, client: str) -> None:
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


def _as_resume_leg(chat_chunks: list[dict[str, Any]], prompt: list[int], generated: list[int]) -> list[dict[str, Any]]:
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
def test_real_chat_answer_preempted_and_resumed_reads_as_the_real_answer(client: str) -> None:
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
def test_real_threshold_rejection_captures(stream_name: str) -> None:
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
