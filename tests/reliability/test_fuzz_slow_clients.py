"""Fuzzing the HTTP surface: truncated bodies (Content-Length larger than what is sent,
then close) and slow clients (headers then a dribbled or stalled body), against `router
--config` (a real process, in front of a simulated engine process). Never a 500, a crash
or a hang; a stalled body gets a 408 and gives its slot back.
"""

from __future__ import annotations

import select
import socket
import time

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.fuzz_http import EXCHANGE_BOUND_S, READ_TIMEOUT_S, assert_alive, assert_no_500s, requests_recorded
from support.polling import eventually_blocking
from support.subprocess_cluster import MODEL, RouterProc

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
    before = requests_recorded(fuzz_router.port)
    for cut in cuts:
        _raw_exchange(fuzz_router.port, _head(len(body)), [(body[:cut], 0.0)], close_after=True)
    # Every request is recorded when the router is done with it: a 500 among them is counted then.
    eventually_blocking(
        lambda: requests_recorded(fuzz_router.port) >= before + len(cuts), 10, "the cut requests recorded"
    )
    assert_alive(fuzz_router.port)
    assert_no_500s(fuzz_router.port)


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
    assert_alive(fuzz_router.port)


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
            assert_alive(fuzz_router.port)
    finally:
        for s in stalled:
            s.close()
    assert_no_500s(fuzz_router.port)


# --- audio uploads: the form fields and the file under the same one deadline ---------------

_BOUNDARY = "fuzzboundary"


def _upload_head(content_length: int) -> bytes:
    return (
        f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: multipart/form-data; boundary={_BOUNDARY}\r\nContent-Length: {content_length}\r\n\r\n"
    ).encode()


def _form(audio: bytes) -> tuple[bytes, bytes]:
    """(the form's `model` field and the file part's headers, the file and the end)."""
    fields = (
        f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{MODEL}\r\n'
        f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    return fields, audio + f"\r\n--{_BOUNDARY}--\r\n".encode()


def _dribble_until_answered(port: int, head: bytes, parts: list[tuple[bytes, float]]) -> bytes:
    """Like `_raw_exchange`, but stops sending once the router answered (it closes then)."""
    with socket.create_connection(("127.0.0.1", port), timeout=EXCHANGE_BOUND_S) as s:
        s.sendall(head)
        for data, pause in parts:
            if select.select([s], [], [], 0)[0]:  # an answer (or a close) came: stop sending
                break
            s.sendall(data)
            time.sleep(pause)  # a slow client pausing between bytes: the behaviour under test
        out = b""
        while not _complete_response(out):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


@pytest.mark.parametrize("dribbled", ["form fields", "file"])
def test_an_upload_dribbled_a_byte_at_a_time_gets_408_at_the_body_timeout(
    fuzz_router: RouterProc, dribbled: str
) -> None:
    """A byte every READ_TIMEOUT_S / 5 never lets one read wait the whole timeout: the
    deadline is the body's, not each read's, so the slot is given back in time."""
    fields, rest = _form(b"\x01" * 200)
    body = fields + rest
    pause = READ_TIMEOUT_S / 5
    if dribbled == "form fields":
        parts = [(body[i : i + 1], pause) for i in range(len(body))]
    else:
        parts = [(fields, 0.0)] + [(rest[i : i + 1], pause) for i in range(len(rest))]
    t0 = time.monotonic()
    out = _dribble_until_answered(fuzz_router.port, _upload_head(len(body)), parts[: int(EXCHANGE_BOUND_S / pause)])
    assert out.startswith(b"HTTP/1.1 408"), out[:300]
    err = orjson.loads(out.split(b"\r\n\r\n", 1)[1])["error"]
    assert "server.body_timeout_s" in err["message"]
    assert time.monotonic() - t0 < EXCHANGE_BOUND_S
    assert_alive(fuzz_router.port)


def test_an_upload_within_the_body_timeout_is_served(fuzz_router: RouterProc) -> None:
    fields, rest = _form(b"\x01" * 200)
    out = _raw_exchange(
        fuzz_router.port,
        _upload_head(len(fields) + len(rest)).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"),
        [(fields, 0.2), (rest, 0.0)],
        close_after=False,
    )
    assert out.startswith(b"HTTP/1.1 200"), out[:300]
