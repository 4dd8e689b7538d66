"""parse_request fuzzed: nothing but a 400 RouterError ever escapes, and an admitted body
carries no internal field."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.admission.spec import (
    ENDPOINT_CHAT,
    ENDPOINT_COMPLETIONS,
    parse_request,
)
from router.errors import RouterError

CMPL = {"model": "m", "prompt": "hello"}


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)


FIELDS = [
    "model",
    "prompt",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "vllm_xargs",
    "cache_hit_threshold",
    "kv_transfer_params",
    "return_token_ids",
    "echo",
    "use_beam_search",
    "prompt_logprobs",
    "prompt_embeds",
    "request_id",
    "temperature",
]


field_values = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8)


def _check_spec_or_400(endpoint: str, raw: bytes) -> None:
    try:
        s = parse_request(endpoint, raw, default_model="d")
    except RouterError as e:
        refused: RouterError | None = e
    else:
        refused = None
    if refused is not None:
        assert refused.status == 400
        orjson.dumps(refused.body())
        return
    # An admitted body is serializable and carries no internal field (a body answered whole
    # keeps the client's own stream and token-id fields).
    orjson.dumps(s.body)
    leg_fields = () if s.whole else ("return_token_ids", "stream", "stream_options")
    for k in ("kv_transfer_params", "cache_hit_threshold", "request_id", *leg_fields):
        assert k not in s.body
    assert not isinstance(s.body.get("vllm_xargs"), dict) or "cache_hit_threshold" not in s.body["vllm_xargs"]
    assert s.max_tokens is None or 1 <= s.max_tokens <= 2**31


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([ENDPOINT_COMPLETIONS, ENDPOINT_CHAT]), field_values)
def test_fuzz_fields_only_router_errors(endpoint: str, fields: dict[str, Any]) -> None:
    _check_spec_or_400(endpoint, orjson.dumps(fields))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([ENDPOINT_COMPLETIONS, ENDPOINT_CHAT]), json_values)
def test_fuzz_any_json_value(endpoint: str, value: Any) -> None:
    _check_spec_or_400(endpoint, orjson.dumps(value))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([ENDPOINT_COMPLETIONS, ENDPOINT_CHAT]), st.binary(max_size=200))
def test_fuzz_random_bytes(endpoint: str, raw: bytes) -> None:
    _check_spec_or_400(endpoint, raw)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([ENDPOINT_COMPLETIONS, ENDPOINT_CHAT]), field_values, st.data())
def test_fuzz_mutated_valid_bodies(endpoint: str, fields: dict[str, Any], data: st.DataObject) -> None:
    base = dict(CMPL if endpoint == ENDPOINT_COMPLETIONS else CHAT)
    base.update(fields)
    raw = orjson.dumps(base)
    # Truncations and byte flips of a near-valid body.
    cut = data.draw(st.integers(0, len(raw)))
    _check_spec_or_400(endpoint, raw[:cut])
    _check_spec_or_400(endpoint, raw)
