"""What a hostile client sends gets a precise 4xx, never a 500, and little log noise.

`router --config` (a real process, with a client key) in front of one simulated engine:
- bodies nested 254 to 1,024 levels deep (orjson parses them but cannot re-serialize
  them for the engine) in any field, chat or completions, streamed or not: 400;
- a `request_id` with control characters: served under that id as vLLM does, with a
  sendable X-Request-Id header (was: zero bytes, or a 500 with a malformed response);
- `Content-Encoding: gzip` on a body that is not gzip: 400 (a real gzip body is served);
- `Expect: 100-continue`: no `100 Continue` before the key and the size are checked;
- malformed HTTP messages and clients hanging up mid-stream: one escaped INFO line each,
  no traceback, no ERROR, no raw control byte in the log.
"""

from __future__ import annotations

import gzip
import http.client
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from support.polling import eventually_blocking
from support.subprocess_cluster import MODEL, RouterProc, SimProc, sim_backends

KEY = "client-key-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    tmp = tmp_path_factory.mktemp("hostile")
    sim = SimProc(["--speed", "50"], log_path=tmp / "sim.log")
    r = RouterProc({"server": {"api_keys": [KEY], "max_body_bytes": MAX_BODY, "body_timeout_s": 5.0}}, tmp)
    try:
        sim.start()
        r.config["backends"] = sim_backends({"d0": sim})
        r.start()
        yield r
    finally:
        r.stop()
        sim.stop()


def _post(
    port: int, path: str, body: bytes, headers: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **AUTH, **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def _error(status: int, raw: bytes, expected: int) -> dict[str, Any]:
    assert status == expected, raw[:300]
    err: dict[str, Any] = orjson.loads(raw)["error"]
    assert err["code"] == expected
    assert isinstance(err["message"], str)
    return err


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _body(chat: bool, stream: bool, where: str, depth: int) -> bytes:
    deep = _nested(depth)
    if chat:
        msg = (
            '{"role": "user", "content": "hi"}'
            if where != "messages"
            else f'{{"role": "user", "content": "hi", "foo": {deep}}}'
        )
        head = f'{{"model": "{MODEL}", "messages": [{msg}], "max_tokens": 3, "stream": {str(stream).lower()}'
    else:
        head = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 3, "stream": {str(stream).lower()}'
    if where == "top":
        head += f', "foo": {deep}'
    elif where == "vllm_xargs":
        head += f', "vllm_xargs": {{"foo": {deep}}}'
    return (head + "}").encode()


@pytest.mark.parametrize("depth", [254, 600, 1024])
@pytest.mark.parametrize("where", ["top", "vllm_xargs", "messages"])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_deeply_nested_bodies_get_400(router: RouterProc, depth: int, where: str, chat: bool, stream: bool) -> None:
    if where == "messages" and not chat:
        where = "top"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, _, raw = _post(router.port, path, _body(chat, stream, where, depth))
    err = _error(status, raw, 400)
    assert "nested" in err["message"] or "depth limit" in err["message"], err


def test_moderately_nested_bodies_are_served(router: RouterProc) -> None:
    # 100 levels in an extra field the engine ignores: within the bound, served.
    status, _, raw = _post(router.port, "/v1/completions", _body(False, False, "top", 100))
    assert status == 200, raw[:300]


@pytest.mark.parametrize(
    "rid", ["a\r\nX-Injected: 1", "a\nb", "a\x00b", "a\x7fb", "\x1b[31mred", "a\u202eb", "a\u0085b"]
)
@pytest.mark.parametrize("stream", [False, True])
def test_request_ids_with_control_characters_are_served_with_a_sendable_header(
    router: RouterProc, rid: str, stream: bool
) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": stream, "request_id": rid})
    status, headers, raw = _post(router.port, "/v1/completions", body)
    assert status == 200, raw[:300]
    assert "X-Injected" not in headers
    assert headers["X-Request-Id"].isprintable()
    assert headers["X-Request-Id"].isascii()
    if stream:
        assert raw.rstrip().endswith(b"data: [DONE]")
        first = orjson.loads(raw.split(b"data: ", 2)[1].split(b"\n")[0])
    else:
        first = orjson.loads(raw)
    assert first["id"] == f"cmpl-{rid}"  # the body's id, as vLLM names the answer


@pytest.mark.parametrize("stream", [False, True])
def test_a_printable_unicode_request_id_is_kept(router: RouterProc, stream: bool) -> None:
    body = orjson.dumps(
        {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": stream, "request_id": "kunde-\u00e9t\u00e9-42"}
    )
    status, _headers, raw = _post(router.port, "/v1/completions", body)
    assert status == 200, raw[:300]
    first = orjson.loads(raw.split(b"data: ", 2)[1].split(b"\n")[0]) if stream else orjson.loads(raw)
    assert first["id"] == "cmpl-kunde-\u00e9t\u00e9-42"


def test_a_body_that_is_not_in_its_content_encoding_gets_400(router: RouterProc) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3})
    for encoding in ("gzip", "deflate"):
        status, _, raw = _post(router.port, "/v1/completions", body, {"Content-Encoding": encoding})
        err = _error(status, raw, 400)
        assert "body could not be read" in err["message"], err
    status, _, raw = _post(router.port, "/v1/completions", gzip.compress(body), {"Content-Encoding": "gzip"})
    assert status == 200, raw[:300]


def _head(path: str, length: int, extra: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nExpect: 100-continue\r\n{extra}\r\n"
    ).encode()


def _read_until(sock: socket.socket, marker: bytes, timeout: float) -> bytes:
    """Everything until `marker` (or the connection closes, or `timeout` passes)."""
    sock.settimeout(timeout)
    out = b""
    end = time.monotonic() + timeout
    while marker not in out and time.monotonic() < end:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            break
        out += data
    return out


@pytest.mark.parametrize("case", ["no key", "too large"])
def test_expect_100_continue_is_not_answered_before_auth_and_size(router: RouterProc, case: str) -> None:
    extra = "" if case == "no key" else f"Authorization: Bearer {KEY}\r\n"
    length = 3 * 1024 * 1024 if case == "no key" else 50 * 1024 * 1024
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(_head("/v1/completions", length, extra))
        # The refusal comes without the body: the client waits for 100 before sending it.
        out = _read_until(sock, b"}}", 10.0)
    assert b"100 Continue" not in out, out[:300]
    status = 401 if case == "no key" else 413
    assert out.startswith(f"HTTP/1.1 {status} ".encode()), out[:300]


def test_expect_100_continue_invites_an_acceptable_body(router: RouterProc) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3})
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(_head("/v1/completions", len(body), f"Authorization: Bearer {KEY}\r\nConnection: close\r\n"))
        interim = _read_until(sock, b"\r\n\r\n", 10.0)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n", interim
        sock.sendall(body)
        out = _read_until(sock, b"}}", 10.0)
    assert out.startswith(b"HTTP/1.1 200 "), out[:300]


MALFORMED = [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad\x00Header: 1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\x1b[31m\r\n",
    b"GET /\x1b[2J\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 20000 + b"\r\n\r\n",
]


def test_client_events_are_one_escaped_info_line_without_traceback(router: RouterProc) -> None:
    # Malformed HTTP messages, some with control bytes that must not reach the log raw.
    for msg in MALFORMED:
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            sock.sendall(msg)
            out = _read_until(sock, b"\r\n\r\n", 5.0)
            assert re.match(rb"HTTP/1\.[01] 4\d\d ", out), (msg[:60], out[:200])
    # Clients hanging up mid-stream, after the first chunk.
    body = orjson.dumps(
        {"model": MODEL, "prompt": "long answer", "max_tokens": 400, "stream": True, "request_id": "hangs-up"}
    )
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert b"data: {" in _read_until(sock, b"data: {", 10.0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    # Every hang-up is recorded (status 499) on the request's own line, once.
    eventually_blocking(
        lambda: router.log_path.read_bytes().count(b'"request_id":"cmpl-hangs-up"') >= 5,
        20,
        "five hang-ups logged",
        interval=0.1,
    )
    log = router.log_path.read_bytes()
    assert log.count(b'"request_id":"cmpl-hangs-up"') == 5
    assert log.count(b'"status":499') >= 5
    assert b"Traceback" not in log, log.decode(errors="replace")[-3000:]
    assert b" ERROR " not in log, log.decode(errors="replace")[-3000:]
    assert log.count(b"client event: ") >= len(MALFORMED)
    raw_controls = [c for c in set(log) if (c < 0x20 and c not in b"\n") or c == 0x7F]
    assert not raw_controls, raw_controls


def test_an_unknown_expectation_gets_417(router: RouterProc) -> None:
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(
            _head("/v1/completions", 10, f"Authorization: Bearer {KEY}\r\n").replace(b"100-continue", b"200-ok")
        )
        out = _read_until(sock, b"}}", 10.0)
    assert out.startswith(b"HTTP/1.1 417 "), out[:300]
    assert orjson.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 417
