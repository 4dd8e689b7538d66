"""Fuzzing the HTTP surface.

Hypothesis drives `router --config` (a real process, in front of a simulated engine
process) with malformed JSON, wrong types, huge and negative numbers, odd unicode,
truncated bodies (Content-Length larger than what is sent, then close) and slow clients
(headers then a dribbled or stalled body), bodies nested up to 1,100 deep in any field,
control characters in every string field, and combinations of Content-Encoding (right,
wrong, truncated), chunked framing, Expect and odd headers. The router never answers 500 (its own fault),
never crashes, never hangs (every exchange is bounded), and keeps serving afterwards.
An answer >= 500 is only acceptable when it names an upstream engine's failure.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.metrics import parse_metrics
from support.polling import eventually_blocking
from support.subprocess_cluster import MODEL, RouterProc, SimProc, sim_backends

READ_TIMEOUT_S = 1.5
EXCHANGE_BOUND_S = 15.0  # any single exchange taking longer is a hang


@pytest.fixture(scope="module")
def fuzz_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    """One engine and one router for the whole module (the fuzzing must not break them:
    every test ends by checking the router still serves)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    sim = SimProc(["--speed", "500", "--max-model-len", "4096"], log_path=tmp / "sim.log")
    router = RouterProc(
        {
            "server": {"max_body_bytes": 256 * 1024, "body_timeout_s": READ_TIMEOUT_S, "max_concurrent_requests": 64},
            "timeouts": {"first_token_s": 10.0, "idle_s": 10.0, "total_s": 20.0},
            "health": {"scrape_interval_s": 0.5, "check_interval_s": 1.0},
            "backends": sim_backends({"d0": sim}),
        },
        tmp,
    )
    try:
        sim.start()
        router.config["backends"] = sim_backends({"d0": sim})
        router.start()
        yield router
    finally:
        router.stop()
        sim.stop()


def _request(
    port: int, method: str, path: str, body: bytes | None, headers: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=EXCHANGE_BOUND_S)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def _check_answer(status: int, headers: dict[str, Any], raw: bytes, what: object) -> None:
    assert status != 500, (what, raw[:500])
    ctype = headers.get("Content-Type", "")
    if status == 200:
        if ctype.startswith("text/event-stream"):
            assert raw.rstrip().endswith(b"data: [DONE]"), (what, raw[-300:])
            for block in raw.split(b"\n\n"):
                if block.startswith(b"data: {"):
                    orjson.loads(block[6:])
        else:
            orjson.loads(raw)
        return
    err = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, (what, err)
    assert err["code"] == status, (what, err)
    if status >= 500:
        assert "pstream" in err["message"] or "engine" in err["message"], (what, err)


def _alive(port: int) -> None:
    status, _, raw = _request(
        port, "POST", "/v1/completions", orjson.dumps({"model": MODEL, "prompt": "still here?", "max_tokens": 2})
    )
    assert status == 200, raw
    assert _request(port, "GET", "/health", None)[0] == 200


def _requests_recorded(port: int) -> float:
    status, _, raw = _request(port, "GET", "/metrics", None)
    assert status == 200
    return parse_metrics(raw.decode()).sample_or_zero("cachehit_router_requests_total")


def _no_500s(port: int) -> None:
    status, _, raw = _request(port, "GET", "/metrics", None)
    assert status == 200
    assert parse_metrics(raw.decode()).sample_or_zero("cachehit_router_requests_total", status="500") == 0


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
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "top_p",
    "logprobs",
    "top_logprobs",
    "echo",
    "stop",
    "seed",
    "vllm_xargs",
    "request_id",
    "kv_transfer_params",
    "cache_hit_threshold",
    "return_token_ids",
    "use_beam_search",
    "prompt_logprobs",
    "prompt_embeds",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
    "user",
]
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
    status, headers, out = _request(fuzz_router.port, "POST", path, raw)
    _check_answer(status, headers, out, body)
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
    status, headers, out = _request(fuzz_router.port, "POST", path, raw, {"Content-Type": ctype})
    _check_answer(status, headers, out, raw[:100])
    assert fuzz_router.process.poll() is None


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
    status, headers, out = _request(fuzz_router.port, "POST", path, json.dumps(body).encode())
    _check_answer(status, headers, out, (field, depth))
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
    status, headers, out = _request(fuzz_router.port, "POST", path, json.dumps(body).encode())
    _check_answer(status, headers, out, body)
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
    _check_answer(status, resp_headers, out, (encoding, actual, chunked, expect, extra))
    assert fuzz_router.process.poll() is None


def test_after_fuzzing_the_router_still_serves(fuzz_router: RouterProc) -> None:
    # Runs on its own router too: odd inputs first, then a normal request.
    for raw in (b"{", b"\xff" * 100, orjson.dumps({"prompt": [2**40]}), orjson.dumps({"max_tokens": -5})):
        status, headers, out = _request(fuzz_router.port, "POST", "/v1/completions", raw)
        _check_answer(status, headers, out, raw)
    _alive(fuzz_router.port)
    _no_500s(fuzz_router.port)


# --- truncated bodies and slow clients ---------------------------------------------------------


def _raw_exchange(port: int, head: bytes, parts: list[tuple[bytes, float]], close_after: bool) -> bytes:
    """Send `head`, then each (bytes, pause) part; optionally close the write side.
    Returns whatever the router answered (b"" if it just closed)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=EXCHANGE_BOUND_S)
    try:
        s.sendall(head)
        for data, pause in parts:
            if data:
                s.sendall(data)
            time.sleep(pause)  # a slow client pausing between bytes: the behaviour under test
        if close_after:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while not _complete_response(out):
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        s.close()


def _complete_response(out: bytes) -> bool:
    head, sep, body = out.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, v = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(v)
    return False  # chunked or unknown: read until the router closes


def _head(content_length: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n\r\n"
    ).encode()


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sent=st.integers(0, 60), missing=st.integers(1, 10_000))
def test_truncated_bodies_then_close_never_crash_the_router(fuzz_router: RouterProc, sent: int, missing: int) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "truncated " * 10, "max_tokens": 2})[:sent]
    t0 = time.monotonic()
    out = _raw_exchange(fuzz_router.port, _head(len(body) + missing), [(body, 0.0)], close_after=True)
    assert time.monotonic() - t0 < EXCHANGE_BOUND_S
    if out:
        status = int(out.split(b" ", 2)[1])
        assert status in (400, 408), out[:300]
    assert fuzz_router.process.poll() is None


def test_truncated_bodies_leave_no_500_and_the_router_serves(fuzz_router: RouterProc) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "cut", "max_tokens": 2})
    cuts = (0, 1, len(body) // 2, len(body) - 1)
    before = _requests_recorded(fuzz_router.port)
    for cut in cuts:
        _raw_exchange(fuzz_router.port, _head(len(body)), [(body[:cut], 0.0)], close_after=True)
    # Every request is recorded when the router is done with it: a 500 among them is counted then.
    eventually_blocking(
        lambda: _requests_recorded(fuzz_router.port) >= before + len(cuts), 10, "the cut requests recorded"
    )
    _alive(fuzz_router.port)
    _no_500s(fuzz_router.port)


def test_a_stalled_body_gets_408_and_does_not_hold_its_slot(fuzz_router: RouterProc) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "stall", "max_tokens": 2})
    t0 = time.monotonic()
    out = _raw_exchange(fuzz_router.port, _head(len(body)), [(body[:5], 0.0)], close_after=False)
    waited = time.monotonic() - t0
    assert out.startswith(b"HTTP/1.1 408"), out[:300]
    err = orjson.loads(out.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == 408
    assert "body_timeout_s" in err["message"]
    assert waited < EXCHANGE_BOUND_S
    _alive(fuzz_router.port)


def test_a_dribbled_body_within_the_timeout_is_served(fuzz_router: RouterProc) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "slow but steady", "max_tokens": 2})
    step = max(1, len(body) // 5)
    parts = [(body[i : i + step], 0.15) for i in range(0, len(body), step)]
    out = _raw_exchange(
        fuzz_router.port,
        _head(len(body)).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"),
        parts,
        close_after=False,
    )
    assert out.startswith(b"HTTP/1.1 200"), out[:300]


def test_stalled_clients_do_not_stop_others_from_being_served(fuzz_router: RouterProc) -> None:
    """Connections that send half a header block or half a body and then stall: the
    router keeps serving everyone else meanwhile."""
    stalled = []
    try:
        for i in range(20):
            s = socket.create_connection(("127.0.0.1", fuzz_router.port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le" if i % 2 else _head(100) + b'{"model"')
            stalled.append(s)
        for _ in range(3):
            _alive(fuzz_router.port)
    finally:
        for s in stalled:
            s.close()
    _no_500s(fuzz_router.port)
