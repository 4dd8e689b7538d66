"""The bodies the router sends upstream: probe/direct, NIXL prefill and decode, resume."""

import pytest

from router.dispatch.disagg import PrefillProtocolError, parse_prefill_response, recompute_after_failed_decode
from router.dispatch.resume import FAILURE, PREEMPTED, REJECTED, resume_reason
from router.engine.errors import BROKEN, CONNECT, ENGINE_ERROR, FIRST_TOKEN_TIMEOUT, STATUS, UpstreamError
from router.engine.wire import (
    PREFILL_REQUEST_PARAMS,
    decode_leg_body,
    prefill_leg_body,
    resume_leg_body,
    streamed_leg_body,
)


def test_streamed_leg_sets_threshold_both_ways_and_keeps_client_xargs():
    body = {"model": "m", "prompt": "hi", "stream": False, "vllm_xargs": {"foo": 1}}
    out = streamed_leg_body(body, 0.5)
    assert out["cache_hit_threshold"] == 0.5
    assert out["vllm_xargs"] == {"foo": 1, "cache_hit_threshold": 0.5}
    assert out["stream"] is True
    assert out["stream_options"] == {"include_usage": True}
    assert out["return_token_ids"] is True
    assert body == {"model": "m", "prompt": "hi", "stream": False, "vllm_xargs": {"foo": 1}}


def test_prefill_leg_matches_the_nixl_protocol():
    body = {
        "model": "m",
        "messages": [],
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
        "temperature": 0.2,
    }
    out = prefill_leg_body(body)
    assert out["max_tokens"] == 1
    assert out["max_completion_tokens"] == 1
    assert out["stream"] is False
    assert "stream_options" not in out
    assert "min_tokens" not in out
    assert out["kv_transfer_params"] == PREFILL_REQUEST_PARAMS
    assert out["temperature"] == 0.2
    assert "max_completion_tokens" not in prefill_leg_body({"prompt": "x"})


def test_decode_leg_carries_the_producers_params_verbatim():
    kv = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_host": "h", "remote_port": 5601}
    out = decode_leg_body({"prompt": "x"}, kv, 0.1)
    assert out["kv_transfer_params"] is kv
    assert out["cache_hit_threshold"] == 0.1


def test_prefill_response_parsing():
    params = parse_prefill_response(
        {"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e"}, "usage": {"prompt_tokens": 526}}
    )
    assert params == {"do_remote_prefill": True, "remote_engine_id": "e"}
    with pytest.raises(PrefillProtocolError):
        parse_prefill_response({"kv_transfer_params": None})


def test_resume_reasons():
    err = UpstreamError("b", "broken", "x")
    assert resume_reason("stop", 5, None, 5) is None
    assert resume_reason("cache_threshold", 5, None, 5) == PREEMPTED
    assert resume_reason("cache_threshold", 0, None, 5) == REJECTED
    assert resume_reason(None, 3, err, 3) == FAILURE
    assert resume_reason(None, 0, err, 0) is None  # before the first token: a retry, not a resume


def test_completion_resume_body():
    body = {"model": "m", "prompt": "hello", "max_tokens": 10, "min_tokens": 4, "echo": False, "temperature": 0}
    out = resume_leg_body(body, "completions", [1, 2, 3], [7, 8, 9], 10)
    assert out["prompt"] == [1, 2, 3, 7, 8, 9]
    assert out["max_tokens"] == 7
    assert out["min_tokens"] == 1
    assert "echo" not in out
    assert out["temperature"] == 0
    assert out["model"] == "m"


def test_chat_resume_body_keeps_only_sampling_fields():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_completion_tokens": 5,
        "temperature": 0.5,
        "logprobs": True,
        "top_logprobs": 2,
        "tools": [],
        "stop": ["\n"],
    }
    out = resume_leg_body(body, "chat", [1], [2, 3], 5)
    assert out == {
        "model": "m",
        "temperature": 0.5,
        "stop": ["\n"],
        "logprobs": 2,
        "prompt": [1, 2, 3],
        "max_tokens": 3,
    }
    assert "max_tokens" not in resume_leg_body({"prompt": "x"}, "completions", [1], [2], None)


def test_prompt_length_estimate_when_no_engine_reported_it():
    from router.routing.planning import RouteQuery
    from router.routing.snapshot import ClusterSnapshot

    # Exact for token ids; else from the learned characters per token (4 until measured).
    assert RouteQuery("m", "5,6,7,", prompt_tokens=3).tokens(ClusterSnapshot(())) == 3
    assert RouteQuery("m", "x" * 4000).tokens(ClusterSnapshot(())) == 1000
    assert RouteQuery("m", "y" * 400).tokens(ClusterSnapshot((), chars_per_token=5.0)) == 80


@pytest.mark.parametrize(
    ("error", "recompute"),
    [
        (None, False),
        # vLLM's answer to a failed KV load (kv_load_failure_policy "fail"): alive, so recompute.
        (UpstreamError("d", ENGINE_ERROR, "Internal server error"), True),
        (UpstreamError("d", STATUS, "Internal server error", status=500), True),
        (UpstreamError("d", STATUS, "Service Unavailable", status=503), True),
        # The engine refused the request itself: it would refuse it again.
        (UpstreamError("d", STATUS, "bad", status=400), False),
        # Nothing says the transfer failed: retry elsewhere as usual.
        (UpstreamError("d", CONNECT, "refused"), False),
        (UpstreamError("d", FIRST_TOKEN_TIMEOUT, "slow"), False),
        (UpstreamError("d", BROKEN, "reset"), False),
    ],
)
def test_recompute_after_failed_decode(error, recompute):
    assert recompute_after_failed_decode(error) is recompute
