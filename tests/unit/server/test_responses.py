"""What `/v1/responses` sends the engine it placed the request on."""

from __future__ import annotations

from router.server.responses import at_threshold_zero


def test_threshold_zero_at_the_top_level_and_in_vllm_xargs() -> None:
    body = {"input": "hi", "vllm_xargs": {"other": 1}}
    assert at_threshold_zero(body) == {
        "input": "hi",
        "cache_hit_threshold": 0.0,
        "vllm_xargs": {"other": 1, "cache_hit_threshold": 0.0},
    }
    assert at_threshold_zero({"input": "hi"})["vllm_xargs"] == {"cache_hit_threshold": 0.0}
    assert body == {"input": "hi", "vllm_xargs": {"other": 1}}  # the client's body is left alone
