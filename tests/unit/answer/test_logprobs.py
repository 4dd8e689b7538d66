"""Logprobs across legs (router/answer/logprobs.py): completion text offsets continue, odd
`top_logprobs` values are the engine's to reject."""

from __future__ import annotations

import orjson

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, parse_request
from router.answer.shaper import ResponseShaper
from support.shaping import PROMPT, make_spec, run_legs, split_legs, steps_for
from support.vllm_serving import (
    Gen,
)


def test_completion_text_offsets_continue_across_legs() -> None:
    spec = make_spec(ENDPOINT_COMPLETIONS, logprobs=1)
    g = Gen(PROMPT, steps_for(3, logprobs=True), logprobs=1)
    legs = split_legs(ENDPOINT_COMPLETIONS, g, [1, 2], [True, False], [None, None, None])
    _, out = run_legs(spec, legs)
    offsets = [o for c in out if c["choices"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 2, 4]


def test_odd_top_logprobs_does_not_break_the_shaper() -> None:
    spec = parse_request(
        ENDPOINT_CHAT,
        orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": "many"}
        ),
    )
    assert spec.body["top_logprobs"] == "many"  # admission leaves it to the engine to reject
    ResponseShaper(spec)  # constructing must not raise
