"""The router's connections held to their limits (router/server/connections.py), against
`router --config` (a real process in front of a simulated engine process): a request head
that does not arrive within server.header_timeout_s gets 408 and the connection closes; an
idle keep-alive connection closes after server.keepalive_timeout_s (aiohttp's own default
is an hour). The waits here are liveness bounds, not speed checks."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import orjson
import pytest

from support.subprocess_cluster import MODEL, RouterProc, SimProc, sim_backends

BOUND_S = 15.0  # far above every limit configured here


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    tmp = tmp_path_factory.mktemp("limits")
    sim = SimProc(["--speed", "500"], log_path=tmp / "sim.log")
    proc = RouterProc({"server": {"header_timeout_s": 1.0, "keepalive_timeout_s": 2.0}}, tmp)
    try:
        sim.start()
        proc.config["backends"] = sim_backends({"d0": sim})
        proc.start()
        yield proc
    finally:
        proc.stop()
        sim.stop()


def _read_to_close(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _read_answer(s: socket.socket) -> bytes:
    """One whole answer (its Content-Length), leaving the connection open."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_stalled_request_head_gets_408_and_its_connection_closes(router: RouterProc) -> None:
    with socket.create_connection(("127.0.0.1", router.port), timeout=BOUND_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        out = _read_to_close(s)
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    err = orjson.loads(out.partition(b"\r\n\r\n")[2])["error"]
    assert "server.header_timeout_s = 1 s" in err["message"]


def test_an_idle_keep_alive_connection_is_closed_after_the_keepalive_timeout(router: RouterProc) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2})
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", router.port), timeout=BOUND_S) as s:
        s.sendall(head.encode() + body)
        answer = _read_answer(s)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        t0 = time.monotonic()
        rest = _read_to_close(s)  # nothing more is sent: the router closes the idle connection
        idle = time.monotonic() - t0
    assert rest == b""
    assert idle < BOUND_S
