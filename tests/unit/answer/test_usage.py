"""Usage across legs (router/answer/usage.py): continuous usage stats as one engine reports them."""

from __future__ import annotations

from router.admission.spec import ENDPOINT_COMPLETIONS, parse_request
from support.shaping import PROMPT, make_spec, run_legs, steps_for
from support.vllm_serving import (
    Gen,
    completion_stream,
)
from support.wire_captures import request_body, stream_chunks


def test_continuous_usage_stats() -> None:
    spec = make_spec(ENDPOINT_COMPLETIONS, include_usage=True, continuous=True)
    _, out = run_legs(spec, [(False, completion_stream(Gen(PROMPT, steps_for(3))))])
    assert [c["usage"]["completion_tokens"] for c in out] == [1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == 4 for c in out)


def test_real_capture_continuous_usage_numbers() -> None:
    client = "completions_stream_continuous_usage"  # max_tokens 2
    spec = parse_request(ENDPOINT_COMPLETIONS, request_body(client))
    _, out = run_legs(spec, [(False, stream_chunks("completions_stream_logprobs"))])  # same 2 tokens
    assert [c.get("usage") for c in out] == [c.get("usage") for c in stream_chunks(client)]
    assert [c["choices"][0]["text"] for c in out if c["choices"]] == [
        c["choices"][0]["text"] for c in stream_chunks(client) if c["choices"]
    ]
