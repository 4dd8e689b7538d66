"""parse_request (router/admission/spec.py): each validation rule (400 naming the field),
stripping, the spec's fields, and the same answers as vLLM for the checks vLLM makes
(fuzzing: test_spec_fuzz.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest

from router.admission.spec import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ENDPOINT_CHAT,
    ENDPOINT_COMPLETIONS,
    MAX_TOKEN_ID,
    RequestSpec,
    parse_request,
)
from router.errors import RouterError
from support.wire_captures import body as wire_body
from support.wire_captures import load as wire_load
from support.wire_captures import request_body


def test_real_threshold_error_captures_are_not_router_errors() -> None:
    # The router owns the threshold: out-of-range client values that the plugin answers with
    # a 400 are stripped at admission instead (documented in router/admission/spec.py).
    for name in ("threshold_error_out_of_range", "threshold_error_out_of_range_xargs"):
        spec = parse_request(ENDPOINT_COMPLETIONS, request_body(name))
        assert "cache_hit_threshold" not in spec.body
        assert "cache_hit_threshold" not in (spec.body.get("vllm_xargs") or {})


CMPL = {"model": "m", "prompt": "hello"}


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def cmpl(**kw: Any) -> RequestSpec:
    return parse_request(ENDPOINT_COMPLETIONS, orjson.dumps({**CMPL, **kw}))


def chat(**kw: Any) -> RequestSpec:
    return parse_request(ENDPOINT_CHAT, orjson.dumps({**CHAT, **kw}))


def rejects(endpoint: str, body: bytes | dict[str, Any], param: str | None) -> RouterError:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(RouterError) as ei:
        parse_request(endpoint, raw)
    assert ei.value.status == 400
    assert ei.value.param == param, ei.value.message
    assert ei.value.body()["error"]["code"] == 400
    return ei.value


def test_completions_spec_defaults() -> None:
    s = cmpl()
    assert s.endpoint == ENDPOINT_COMPLETIONS
    assert s.model == "m"
    assert s.request_id.startswith("cmpl-")
    assert len(s.request_id) == 5 + 32
    assert (s.stream, s.include_usage, s.continuous_usage, s.return_token_ids) == (False, False, False, False)
    assert s.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS  # vLLM's default when absent
    assert s.prompt_token_ids is None
    assert s.routing_text == "hello"
    assert s.body == CMPL
    assert s.created > 1_600_000_000
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.model = "x"  # type: ignore[misc]


def test_ids_are_unique_and_chat_prefixed() -> None:
    assert chat().request_id.startswith("chatcmpl-")
    assert cmpl().request_id != cmpl().request_id


def test_client_request_id_names_the_answer_like_vllm_and_is_not_forwarded() -> None:
    s = chat(request_id="abc")
    assert s.request_id == "chatcmpl-abc"
    assert "request_id" not in s.body
    rejects(ENDPOINT_CHAT, {**CHAT, "request_id": 5}, "request_id")
    rejects(ENDPOINT_CHAT, {**CHAT, "request_id": ""}, "request_id")


def test_streaming_flags() -> None:
    s = chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert (s.stream, s.include_usage, s.continuous_usage) == (True, True, True)
    s = chat(stream=True, stream_options={"continuous_usage_stats": True})
    assert (s.include_usage, s.continuous_usage) == (False, False)  # only with include_usage, as in vLLM
    s = chat(stream=True, stream_options=None)
    assert (s.stream, s.include_usage) == (True, False)
    # An empty stream_options without stream is allowed, as in vLLM (it is falsy).
    assert chat(stream_options={}).stream is False


def test_token_id_prompts() -> None:
    assert cmpl(prompt=[1, 2, 3]).prompt_token_ids == (1, 2, 3)
    assert cmpl(prompt=[[0, MAX_TOKEN_ID]]).prompt_token_ids == (0, MAX_TOKEN_ID)
    s = cmpl(prompt=["only one"])
    assert s.routing_text == "only one"
    assert s.prompt_token_ids is None
    assert cmpl(prompt=[7, 80]).routing_text == "7,80,"
    assert cmpl(prompt=[7, 80, 9]).routing_text.startswith(cmpl(prompt=[7, 80]).routing_text)
    assert not cmpl(prompt=[7, 800]).routing_text.startswith(cmpl(prompt=[7, 80]).routing_text)
    # A bad id is named, whatever makes it one (past 64 bits: a float to orjson).
    for raw, named in ((b"[1,1e3]", "1000.0"), (b"[1,1180591620717411303424]", "1.1805916207174113e+21")):
        bad = rejects(ENDPOINT_COMPLETIONS, b'{"model":"m","prompt":' + raw + b"}", "prompt")
        assert bad.message.endswith(f"got {named}.")


def test_budgets() -> None:
    assert cmpl(max_tokens=5).max_tokens == 5
    assert cmpl(max_tokens=None).max_tokens is None  # explicit null: up to the context
    assert chat().max_tokens is None
    assert chat(max_tokens=7).max_tokens == 7
    assert chat(max_tokens=7, max_completion_tokens=3).max_tokens == 3
    assert chat(max_tokens=7, max_completion_tokens=None).max_tokens == 7
    assert cmpl(max_tokens=2**31).max_tokens == 2**31


def test_default_model() -> None:
    s = parse_request(ENDPOINT_CHAT, orjson.dumps({"messages": CHAT["messages"]}), default_model="d")
    assert s.model == "d"
    assert "model" not in s.body
    s = parse_request(ENDPOINT_CHAT, orjson.dumps({**CHAT, "model": None}), default_model="d")
    assert s.model == "d"
    rejects(ENDPOINT_CHAT, {"messages": CHAT["messages"]}, "model")


def test_chat_routing_text_renders_roles_and_text_parts() -> None:
    s = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {}},
                    {"type": "text", "text": "b"},
                    "junk",
                ],
            },
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool"},
        ]
    )
    assert s.routing_text == "system: be brief\nuser: ab\nassistant: \ntool: "


def test_other_fields_pass_through_unchanged() -> None:
    extra = {
        "temperature": 0.5,
        "top_p": 2.5,
        "stop": ["x"],
        "logprobs": 3,
        "seed": 2**63 - 1,
        "user": "u\u2028\U0001f600",
        "suffix": None,
        "min_tokens": 4,
        "whatever": {"a": [1]},
    }
    assert cmpl(**extra).body == {**CMPL, **extra}


def test_internal_fields_are_stripped() -> None:
    s = chat(
        kv_transfer_params={"do_remote_prefill": True},
        ec_transfer_params={},
        cache_hit_threshold=0.9,
        return_token_ids=True,
        stream=True,
        stream_options={"include_usage": True},
        vllm_xargs={
            "cache_hit_threshold": 0.3,
            "kv_transfer_params": "x",
            "ec_transfer_params": "y",
            "other": 1,
            "list": [1, "a"],
        },
    )
    assert s.body == {**CHAT, "vllm_xargs": {"other": 1, "list": [1, "a"]}}
    assert s.return_token_ids is True
    assert s.include_usage is True


def test_xargs_without_threshold_untouched_and_emptied_xargs_dropped() -> None:
    assert chat(vllm_xargs={"k": "v"}).body["vllm_xargs"] == {"k": "v"}
    assert "vllm_xargs" not in chat(vllm_xargs={"cache_hit_threshold": 1}).body
    assert chat(vllm_xargs=None).body["vllm_xargs"] is None


def test_out_of_range_threshold_is_stripped_not_rejected() -> None:
    # The router owns the threshold: a client's value, valid or not, is dropped.
    assert "cache_hit_threshold" not in chat(cache_hit_threshold=7).body
    assert "cache_hit_threshold" not in chat(cache_hit_threshold="x").body


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"\xff\xfe",
        b'{"a": NaN}',
        b'{"a": Infinity}',
        b'{"a": 1e400}',
        b'{"a": "\\ud800"}',
        b"\xef\xbb\xbf{}",
        b"[]",
        b"1",
        b'"x"',
        b"null",
        b"[" * 5000,
    ],
)
def test_malformed_bodies(raw: bytes) -> None:
    rejects(ENDPOINT_CHAT, raw, None)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": 1, "prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({**CMPL, "prompt": ""}, "prompt"),
        ({**CMPL, "prompt": []}, "prompt"),
        ({**CMPL, "prompt": None}, "prompt"),
        ({**CMPL, "prompt": 5}, "prompt"),
        ({**CMPL, "prompt": {"a": 1}}, "prompt"),
        *(({**CMPL, "prompt": [1, bad]}, "prompt") for bad in [-1, 2**31, True, 2.0, 2**64 - 1, "a", [2], None, {}]),
        ({**CMPL, "prompt": [[]]}, "prompt"),
        ({**CMPL, "prompt": ["a", ""]}, "prompt[1]"),
        ({**CMPL, "prompt": [[1], ["a"]]}, "prompt[1]"),
        ({**CMPL, "prompt": ["a", 5]}, "prompt[1]"),
        ({**CMPL, "prompt": [""]}, "prompt"),
        ({**CMPL, "prompt": [["a"]]}, "prompt"),
        ({**CMPL, "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({**CMPL, "echo": "yes"}, "echo"),
        ({**CMPL, "stream": "true"}, "stream"),
        ({**CMPL, "stream": 1}, "stream"),
        ({**CMPL, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CMPL, "stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
        ({**CMPL, "stream": True, "stream_options": []}, "stream_options"),
        ({**CMPL, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        (
            {**CMPL, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
            "stream_options.continuous_usage_stats",
        ),
        ({**CMPL, "max_tokens": 0}, "max_tokens"),
        ({**CMPL, "max_tokens": -3}, "max_tokens"),
        ({**CMPL, "max_tokens": 1.5}, "max_tokens"),
        ({**CMPL, "max_tokens": 16.0}, "max_tokens"),
        ({**CMPL, "max_tokens": "16"}, "max_tokens"),
        ({**CMPL, "max_tokens": True}, "max_tokens"),
        ({**CMPL, "max_tokens": 2**31 + 1}, "max_tokens"),
        ({**CMPL, "max_tokens": 18446744073709551615}, "max_tokens"),
        ({**CMPL, "max_tokens": 1e300}, "max_tokens"),
        ({**CMPL, "n": 0}, "n"),
        ({**CMPL, "n": -2}, "n"),
        ({**CMPL, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({**CMPL, "prompt_logprobs": -1, "stream": True}, "prompt_logprobs"),
        ({**CMPL, "n": True}, "n"),
        ({**CMPL, "n": "1"}, "n"),
        ({**CMPL, "vllm_xargs": [1]}, "vllm_xargs"),
        ({**CMPL, "vllm_xargs": "x"}, "vllm_xargs"),
        ({**CMPL, "return_token_ids": "yes"}, "return_token_ids"),
    ],
)
def test_completions_rules(body: dict[str, Any], param: str) -> None:
    rejects(ENDPOINT_COMPLETIONS, body, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": {"role": "user"}}, "messages"),
        ({"model": "m", "messages": [1]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": "a"}, {"content": "b"}]}, "messages[1].role"),
        ({"model": "m", "messages": [{"role": None}]}, "messages[0].role"),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({**CHAT, "max_tokens": -1, "max_completion_tokens": 5}, "max_tokens"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_chat_rules(body: dict[str, Any], param: str) -> None:
    rejects(ENDPOINT_CHAT, body, param)


@pytest.mark.parametrize(
    ("endpoint", "fields"),
    [
        (ENDPOINT_COMPLETIONS, {"n": 2}),
        (ENDPOINT_COMPLETIONS, {"prompt": ["a", "b"]}),
        (ENDPOINT_COMPLETIONS, {"prompt": [[1, 2], [3]]}),
        (ENDPOINT_COMPLETIONS, {"echo": True}),
        (ENDPOINT_COMPLETIONS, {"prompt_logprobs": 0}),  # (more are refused in a stream)
        (ENDPOINT_COMPLETIONS, {"use_beam_search": True}),
        (ENDPOINT_CHAT, {"n": 3}),
        (ENDPOINT_CHAT, {"prompt_logprobs": 0}),
    ],
)
def test_features_only_an_engine_can_compose_are_answered_whole(endpoint: str, fields: dict[str, Any]) -> None:
    base = CMPL if endpoint == ENDPOINT_COMPLETIONS else CHAT
    body = {
        **base,
        **fields,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "kv_transfer_params": {"do_remote_prefill": True},
        "cache_hit_threshold": 0.9,
        "request_id": "mine",
    }
    s = parse_request(endpoint, orjson.dumps(body))
    assert s.whole
    assert s.stream
    assert s.request_id.endswith("-mine")
    # The client's own streaming and token-id fields reach the engine; internal ones never.
    assert s.body["stream"] is True
    assert s.body["return_token_ids"] is True
    assert s.body["stream_options"] == {"include_usage": True}
    for internal in ("kv_transfer_params", "cache_hit_threshold", "request_id"):
        assert internal not in s.body
    for k, v in fields.items():
        assert s.body[k] == v
    # One prompt, n = 1: raced as before, the router's fields stripped.
    plain = parse_request(
        endpoint, orjson.dumps({**base, "n": 1, "prompt": ["a"]} if base is CMPL else {**base, "n": 1})
    )
    assert not plain.whole


def test_chat_echo_and_odd_content_pass_through() -> None:
    # Chat echo does not interact with token ids; odd content is the engine's to judge.
    s = chat(echo=True, messages=[{"role": "user", "content": 5}])
    assert s.body["echo"] is True
    assert s.routing_text == "user: "


def test_unknown_endpoint_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown endpoint"):
        parse_request("embeddings", b"{}")


@pytest.mark.parametrize("name", ["error_missing_prompt", "error_out_of_range_max_tokens"])
def test_same_error_body_as_vllm_for_checks_vllm_makes(name: str) -> None:
    req = wire_load(name)["request"]["body"]
    with pytest.raises(RouterError) as ei:
        parse_request(ENDPOINT_COMPLETIONS, orjson.dumps(req))
    assert ei.value.status == wire_load(name)["status"]
    assert ei.value.body() == wire_body(name)


@pytest.mark.parametrize(
    ("name", "endpoint"),
    [
        ("error_bad_type_max_tokens", ENDPOINT_COMPLETIONS),
        ("error_chat_bad_messages", ENDPOINT_CHAT),
        ("error_invalid_json", ENDPOINT_COMPLETIONS),
    ],
)
def test_type_errors_same_status_and_field_as_vllm(name: str, endpoint: str) -> None:
    # vLLM reports pydantic's wording and "body.<field>"; the router names the field alone.
    req = wire_load(name)["request"]["body"]
    raw = req.encode() if isinstance(req, str) else orjson.dumps(req)
    with pytest.raises(RouterError) as ei:
        parse_request(endpoint, raw)
    want = wire_body(name)["error"]
    assert ei.value.status == want["code"]
    if ei.value.param is not None:
        assert want["param"] == f"body.{ei.value.param}"


def test_requests_vllm_accepts_are_admitted() -> None:
    for name in (
        "completions",
        "completions_stream_usage_token_ids",
        "completions_token_ids_prompt_ids",
        "completions_logprobs",
        "model_specific/completions_stop_token",
        "chat",
        "chat_stream_logprobs",
        "chat_max_completion_tokens",
        "completions_unknown_field_cache_hit_threshold",
    ):
        req = wire_load(name)["request"]
        endpoint = ENDPOINT_CHAT if "chat" in req["path"] else ENDPOINT_COMPLETIONS
        spec = parse_request(endpoint, orjson.dumps(req["body"]))
        assert (spec.endpoint, spec.model, spec.stream) == (
            endpoint,
            req["body"]["model"],
            bool(req["body"].get("stream")),
        ), name
