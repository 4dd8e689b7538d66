"""Fuzzing the HTTP surface: bodies nested up to 1,100 deep in any field, control
characters in every string field, and combinations of Content-Encoding (right, wrong,
truncated), chunked framing, Expect and odd headers, against `router --config` (a real
process, in front of a simulated engine process). Never a 500 of the router's own, never
a crash or a hang; the router keeps serving afterwards.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.fuzz_http import EXCHANGE_BOUND_S, FIELDS, assert_alive, assert_no_500s, check_answer, fuzz_request
from support.subprocess_cluster import MODEL, RouterProc

# --- nesting depth, control characters, headers and encodings ----------------------------


def _nested(depth: int, leaf: Any, kinds: list[bool]) -> Any:
    """`leaf` inside `depth` levels of arrays and objects (kinds[i]: object at level i)."""
    v = leaf
    for i in range(depth):
        v = {"k": v} if kinds[i % len(kinds)] else [v]
    return v


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    depth=st.one_of(st.integers(1, 140), st.integers(120, 1100), st.sampled_from([127, 128, 129, 253, 254, 255])),
    field=st.sampled_from([*FIELDS, "foo", "vllm_xargs.foo"]),
    kinds=st.lists(st.booleans(), min_size=1, max_size=3),
    chat=st.booleans(),
    stream=st.booleans(),
)
def test_deeply_nested_bodies_get_a_clear_answer(
    fuzz_router: RouterProc, depth: int, field: str, kinds: list[bool], chat: bool, stream: bool
) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "stream": stream,
        **({"messages": [{"role": "user", "content": "deep"}]} if chat else {"prompt": "deep"}),
    }
    nested = _nested(depth, 1, kinds)
    if field == "vllm_xargs.foo":
        body["vllm_xargs"] = {"foo": nested}
    else:
        body[field] = nested
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, headers, out = fuzz_request(fuzz_router.port, "POST", path, json.dumps(body).encode())
    check_answer(status, headers, out, (field, depth))
    if depth + (1 if field == "vllm_xargs.foo" else 0) > 128:
        assert status == 400, (field, depth, out[:300])
    assert fuzz_router.process.poll() is None


control_text = st.lists(
    st.sampled_from(
        [chr(c) for c in range(0, 32)]
        + ["\x7f", "\x85", "\u2028", "\u2029", "\u202e", "\u200b", "\ufeff", "\x1b[31m", "a", " "]
    ),
    min_size=1,
    max_size=12,
).map("".join)
STRING_FIELDS = [
    "model",
    "prompt",
    "request_id",
    "user",
    "stop",
    "messages.content",
    "messages.role",
    "messages.name",
    "vllm_xargs.foo",
    "response_format.type",
    "tool_choice",
]


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(STRING_FIELDS), text=control_text, chat=st.booleans(), stream=st.booleans())
def test_control_characters_in_any_string_field_never_get_a_500(
    fuzz_router: RouterProc, field: str, text: str, chat: bool, stream: bool
) -> None:
    message = {"role": "user", "content": "ctl"}
    body = {"model": MODEL, "max_tokens": 2, "stream": stream}
    if field.startswith("messages."):
        chat = True
        message[field.split(".", 1)[1]] = text
    elif field == "vllm_xargs.foo":
        body["vllm_xargs"] = {"foo": text}
    elif field == "response_format.type":
        body["response_format"] = {"type": text}
    else:
        body[field] = text
    body.update({"messages": [message]} if chat else {"prompt": body.get("prompt", "ctl")})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, headers, out = fuzz_request(fuzz_router.port, "POST", path, json.dumps(body).encode())
    check_answer(status, headers, out, body)
    assert headers.get("X-Request-Id", "").isprintable()  # whatever the body's request_id holds
    assert fuzz_router.process.poll() is None


def _encode(body: bytes, how: str) -> bytes:
    import gzip
    import zlib

    encoders: dict[str, Callable[[bytes], bytes]] = {
        "gzip": lambda b: gzip.compress(b),
        "deflate": lambda b: zlib.compress(b),
        "plain": lambda b: b,
        "truncated-gzip": lambda b: gzip.compress(b)[:-6],
        "garbage": lambda b: b"\x1f\x8b\x08\x00garbage" + b,
    }
    return encoders[how](body)


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    encoding=st.sampled_from(["gzip", "deflate", "br", "identity", "gzip, gzip", "x-junk", "GZIP", ""]),
    actual=st.sampled_from(["gzip", "deflate", "plain", "truncated-gzip", "garbage"]),
    chunked=st.booleans(),
    expect=st.sampled_from([None, "100-continue", "100-Continue", "200-ok", ""]),
    extra=st.dictionaries(
        st.sampled_from(
            [
                "Authorization",
                "X-Request-Priority",
                "X-Request-Id",
                "Accept",
                "Accept-Encoding",
                "Content-Type",
                "Connection",
                "TE",
                "Forwarded",
            ]
        ),
        st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
        max_size=3,
    ),
    stream=st.booleans(),
)
def test_header_and_encoding_combinations_never_get_a_500(
    fuzz_router: RouterProc,
    encoding: str,
    actual: str,
    chunked: bool,
    expect: str | None,
    extra: dict[str, str],
    stream: bool,
) -> None:
    raw = _encode(orjson.dumps({"model": MODEL, "prompt": "enc", "max_tokens": 2, "stream": stream}), actual)
    headers = {"Content-Type": "application/json", **extra}
    if encoding:
        headers["Content-Encoding"] = encoding
    if expect is not None:
        headers["Expect"] = expect
    headers["Connection"] = "close"  # the answer ends with the connection
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (raw[:7], raw[7:]) if p) + b"0\r\n\r\n"
    else:
        headers["Content-Length"] = str(len(raw))
        payload = raw
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s = socket.create_connection(("127.0.0.1", fuzz_router.port), timeout=EXCHANGE_BOUND_S)
    got = b""
    try:
        # All at once, as a client that does not wait for 100 Continue: the router may
        # refuse before reading the body and close, so the send can fail; its answer is
        # still there to read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + payload)
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
    finally:
        s.close()
    while got.startswith(b"HTTP/1.1 100"):  # an interim answer: the real one follows
        got = got.partition(b"\r\n\r\n")[2]
    if got.startswith(b"HTTP/1.0 400 ") and b"Can not decode content-encoding" in got:
        # Known limit: aiohttp's HTTP parser refuses a Content-Encoding it cannot decode
        # (br without the Brotli package) with its own plain-text 400, before the router
        # sees the request. A 400 all the same, never a 500.
        assert got.startswith(b"HTTP/1.0 400 "), got[:200]
        return
    assert got.startswith(b"HTTP/1.1 "), (encoding, actual, chunked, expect, extra, got[:200])
    head_raw, _, out = got.partition(b"\r\n\r\n")
    status = int(head_raw.split(b" ", 2)[1])
    resp_headers = {
        k.decode(): v.strip().decode() for k, _, v in (line.partition(b":") for line in head_raw.split(b"\r\n")[1:])
    }
    if resp_headers.get("Transfer-Encoding", "").lower() == "chunked":
        body, rest = b"", out
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body, rest = body + rest[:size], rest[size + 2 :]
        out = body
    check_answer(status, resp_headers, out, (encoding, actual, chunked, expect, extra))
    assert fuzz_router.process.poll() is None


def test_after_fuzzing_the_router_still_serves(fuzz_router: RouterProc) -> None:
    # Runs on its own router too: odd inputs first, then a normal request.
    for raw in (b"{", b"\xff" * 100, orjson.dumps({"prompt": [2**40]}), orjson.dumps({"max_tokens": -5})):
        status, headers, out = fuzz_request(fuzz_router.port, "POST", "/v1/completions", raw)
        check_answer(status, headers, out, raw)
    assert_alive(fuzz_router.port)
    assert_no_500s(fuzz_router.port)
