"""The requests tests/real_engine/capture_wire.py sends to a real vLLM engine, by capture
name: plain vLLM cases, the threshold plugin's cases and the prompt-tokens-details cases
(docs/VLLM_WIRE.md). Each is (method, path, body); a `bytes` body is sent verbatim."""

from __future__ import annotations

from typing import Any

PROMPT = "The river and the mountain are quiet in the morning light"
MESSAGES = [{"role": "user", "content": "Hello, which river is quiet in the morning?"}]
GREEDY = {"temperature": 0, "max_tokens": 4}


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT, **GREEDY, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, **GREEDY, **kw}


USAGE = {"stream_options": {"include_usage": True}}

# name -> (method, path, body). Bodies are sent as JSON; a `bytes` body is sent verbatim.
CASES: dict[str, tuple[str, str, object]] = {
    # --- /v1/completions
    "completions": ("POST", "/v1/completions", comp()),
    "completions_token_ids": ("POST", "/v1/completions", comp(return_token_ids=True)),
    "completions_token_ids_prompt_ids": (
        "POST",
        "/v1/completions",
        comp(prompt=[0, 1017, 705, 769, 364, 708, 22, 22], return_token_ids=True),
    ),
    "completions_logprobs": ("POST", "/v1/completions", comp(logprobs=2, max_tokens=2)),
    "completions_n2": ("POST", "/v1/completions", comp(n=2, max_tokens=2, temperature=1.0, seed=7)),
    "completions_stream": ("POST", "/v1/completions", comp(stream=True)),
    "completions_stream_usage": ("POST", "/v1/completions", comp(stream=True, **USAGE)),
    "completions_stream_usage_token_ids": (
        "POST",
        "/v1/completions",
        comp(stream=True, return_token_ids=True, **USAGE),
    ),
    "completions_stream_continuous_usage": (
        "POST",
        "/v1/completions",
        comp(stream=True, max_tokens=2, stream_options={"include_usage": True, "continuous_usage_stats": True}),
    ),
    "completions_stream_logprobs": (
        "POST",
        "/v1/completions",
        comp(stream=True, logprobs=2, max_tokens=2, return_token_ids=True, **USAGE),
    ),
    "completions_stream_n2": (
        "POST",
        "/v1/completions",
        comp(stream=True, n=2, max_tokens=2, temperature=1.0, seed=7, return_token_ids=True, **USAGE),
    ),
    # Greedy output of PROMPT starts " Window" (793), "05" (1100), " Much" (992). Answers
    # that depend on this model's tokens go to model_specific/ (not replayed on other models).
    "model_specific/completions_stop_token": (
        "POST",
        "/v1/completions",
        comp(max_tokens=4, stop_token_ids=[1100], return_token_ids=True),
    ),
    "model_specific/completions_stream_stop_token": (
        "POST",
        "/v1/completions",
        comp(stream=True, max_tokens=4, stop_token_ids=[1100], return_token_ids=True, **USAGE),
    ),
    "model_specific/completions_stop_string": (
        "POST",
        "/v1/completions",
        comp(max_tokens=4, stop=[" Much"], return_token_ids=True),
    ),
    "model_specific/completions_stream_stop_string": (
        "POST",
        "/v1/completions",
        comp(stream=True, max_tokens=4, stop=[" Much"], return_token_ids=True, **USAGE),
    ),
    "completions_unknown_field_cache_hit_threshold": (
        "POST",
        "/v1/completions",
        comp(cache_hit_threshold=0.5, max_tokens=1),
    ),
    # --- /v1/chat/completions
    "chat": ("POST", "/v1/chat/completions", chat()),
    "chat_token_ids": ("POST", "/v1/chat/completions", chat(return_token_ids=True)),
    "chat_logprobs": ("POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=2, max_tokens=2)),
    "chat_max_completion_tokens": (
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_completion_tokens": 2},
    ),
    "chat_stream": ("POST", "/v1/chat/completions", chat(stream=True)),
    "chat_stream_usage": ("POST", "/v1/chat/completions", chat(stream=True, **USAGE)),
    "chat_stream_usage_token_ids": ("POST", "/v1/chat/completions", chat(stream=True, return_token_ids=True, **USAGE)),
    "chat_stream_logprobs": (
        "POST",
        "/v1/chat/completions",
        chat(stream=True, logprobs=True, top_logprobs=2, max_tokens=2, **USAGE),
    ),
    # --- errors
    "error_bad_type_max_tokens": ("POST", "/v1/completions", comp(max_tokens="many")),
    "error_out_of_range_temperature": ("POST", "/v1/completions", comp(temperature=-1)),
    "error_out_of_range_max_tokens": ("POST", "/v1/completions", comp(max_tokens=0)),
    "error_unknown_model": ("POST", "/v1/completions", comp(model="no-such-model")),
    "error_unknown_model_chat": ("POST", "/v1/chat/completions", chat(model="no-such-model")),
    "error_prompt_too_long": ("POST", "/v1/completions", comp(prompt=[5] * 2100)),
    "error_prompt_plus_max_tokens_too_long": ("POST", "/v1/completions", comp(prompt=[5] * 2000, max_tokens=100)),
    "error_prompt_too_long_stream": ("POST", "/v1/completions", comp(prompt=[5] * 2100, stream=True, **USAGE)),
    "error_chat_bad_messages": ("POST", "/v1/chat/completions", {"model": "tiny", "messages": "hello"}),
    "error_missing_prompt": ("POST", "/v1/completions", {"model": "tiny", "max_tokens": 2}),
    "error_invalid_json": ("POST", "/v1/completions", b'{"model": "tiny", "prompt": '),
    # --- other endpoints
    "models": ("GET", "/v1/models", None),
    "health": ("GET", "/health", None),
    "version": ("GET", "/version", None),
}

DISAGG_PROMPT = " ".join(["the cache block is ready for the decode engine"] * 12)

# Plugin cases: sent to an engine with the plugin loaded.
THRESHOLD_PROMPT = "A cold prompt that no engine has seen: " + " ".join(["winter river"] * 20)
THRESHOLD_CASES: dict[str, tuple[str, str, object]] = {
    "threshold_completions_rejected": (
        "POST",
        "/v1/completions",
        comp(prompt=THRESHOLD_PROMPT, cache_hit_threshold=0.9, return_token_ids=True),
    ),
    "threshold_completions_stream_rejected": (
        "POST",
        "/v1/completions",
        comp(
            prompt=THRESHOLD_PROMPT + " a",
            stream=True,
            return_token_ids=True,
            vllm_xargs={"cache_hit_threshold": 0.9},
            **USAGE,
        ),
    ),
    "threshold_chat_rejected": (
        "POST",
        "/v1/chat/completions",
        chat(
            messages=[{"role": "user", "content": THRESHOLD_PROMPT + " b"}],
            cache_hit_threshold=0.9,
            return_token_ids=True,
        ),
    ),
    "threshold_chat_stream_rejected": (
        "POST",
        "/v1/chat/completions",
        chat(
            messages=[{"role": "user", "content": THRESHOLD_PROMPT + " c"}],
            stream=True,
            cache_hit_threshold=0.9,
            return_token_ids=True,
            **USAGE,
        ),
    ),
    "threshold_error_out_of_range": ("POST", "/v1/completions", comp(cache_hit_threshold=1.5)),
    "threshold_error_out_of_range_xargs": ("POST", "/v1/completions", comp(vllm_xargs={"cache_hit_threshold": "0.5"})),
}

# `engine-launcher` starts every vLLM engine with --enable-prompt-tokens-details; these cases
# show what that flag changes (usage.prompt_tokens_details), written to
# prompt_tokens_details/ by `--details` (an engine with that flag and the plugin).
DETAILS_PROMPT = "Details prompt for the cached token count: " + " ".join(["silver harbor lantern"] * 15)
DETAILS_CASES: dict[str, tuple[str, str, object]] = {
    "prompt_tokens_details/completions_cold": (
        "POST",
        "/v1/completions",
        comp(prompt=DETAILS_PROMPT, cache_hit_threshold=0, return_token_ids=True),
    ),
    "prompt_tokens_details/completions_cached": (
        "POST",
        "/v1/completions",
        comp(prompt=DETAILS_PROMPT, cache_hit_threshold=0, return_token_ids=True),
    ),
    "prompt_tokens_details/completions_stream_usage": (
        "POST",
        "/v1/completions",
        comp(prompt=DETAILS_PROMPT, cache_hit_threshold=0, stream=True, return_token_ids=True, **USAGE),
    ),
    "prompt_tokens_details/chat_stream_usage": (
        "POST",
        "/v1/chat/completions",
        chat(cache_hit_threshold=0, stream=True, return_token_ids=True, **USAGE),
    ),
    "prompt_tokens_details/threshold_completions_rejected": (
        "POST",
        "/v1/completions",
        comp(prompt=THRESHOLD_PROMPT + " details", cache_hit_threshold=0.9, return_token_ids=True),
    ),
    "prompt_tokens_details/threshold_completions_stream_rejected": (
        "POST",
        "/v1/completions",
        comp(
            prompt=THRESHOLD_PROMPT + " details stream",
            stream=True,
            cache_hit_threshold=0.9,
            return_token_ids=True,
            **USAGE,
        ),
    ),
}
