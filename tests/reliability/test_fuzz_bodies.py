"""Fuzzing the HTTP surface: JSON bodies and raw bytes.

Hypothesis drives `router --config` (a real process, in front of a simulated engine
process) with malformed JSON, wrong types, huge and negative numbers and odd unicode. The
router never answers 500 (its own fault), never crashes, never hangs (every exchange is
bounded), and keeps serving afterwards. An answer >= 500 is only acceptable when it names
an upstream engine's failure. The router and the checks are support/fuzz_http.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.fuzz_http import FIELDS, check_answer, fuzz_request
from support.subprocess_cluster import MODEL, RouterProc

# --- JSON bodies ----------------------------------------------------------------------------

odd_text = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40) | st.sampled_from(
    [
        "",
        "\u0000",
        "\u202e\u202d",
        "\U0001f600" * 20,
        "a\u0301" * 10,
        "\ufeff",
        "\\u0000",
        "null",
        "http://127.0.0.1:1/x",
        "' OR 1=1 --",
        "%s%n%x",
        "\r\n\r\nGET / HTTP/1.1",
    ]
)
odd_number = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**31 + 1, 2**63, -(2**63), 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 5e-324, -0.0]),
)
scalar = st.one_of(st.none(), st.booleans(), odd_number, odd_text)
value = st.recursive(
    scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=4), max_leaves=12
)
sane = {
    "model": st.just(MODEL),
    "prompt": st.just("fuzz"),
    "max_tokens": st.integers(1, 8),
    "messages": st.just([{"role": "user", "content": "fuzz"}]),
}


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly-valid bodies with a few fields replaced by odd values, so the fuzzing gets
    past the first check and reaches the router's deeper paths (and the engine)."""
    body = {k: draw(v) for k, v in sane.items() if draw(st.booleans())}
    for k in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[k] = draw(value)
    return body


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies(), chat=st.booleans())
def test_fuzzed_json_bodies_never_get_a_500_or_hang(fuzz_router: RouterProc, body: dict[str, Any], chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    # The stdlib encoder: it writes integers of any size (orjson stops at 64 bits).
    raw = json.dumps(body, ensure_ascii=bool(chat)).encode()
    status, headers, out = fuzz_request(fuzz_router.port, "POST", path, raw)
    check_answer(status, headers, out, body)
    assert fuzz_router.process.poll() is None


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    raw=st.one_of(
        st.binary(max_size=300),
        st.sampled_from(
            [
                b"{",
                b'{"model":',
                b"[]",
                b"null",
                b'"x"',
                b"1e999",
                b'{"prompt": NaN}',
                b'{"prompt": "\\ud800"}',
                b'\xef\xbb\xbf{"prompt": "bom"}',
                b'{"prompt": "x", "prompt": 5}',
                b"{" * 5000,
                b"[" * 100_000,
                b'{"max_tokens": ' + b"9" * 5000 + b"}",
            ]
        ),
    ),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    ctype=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
)
def test_fuzzed_raw_bytes_never_get_a_500_or_hang(fuzz_router: RouterProc, raw: bytes, path: str, ctype: str) -> None:
    status, headers, out = fuzz_request(fuzz_router.port, "POST", path, raw, {"Content-Type": ctype})
    check_answer(status, headers, out, raw[:100])
    assert fuzz_router.process.poll() is None
