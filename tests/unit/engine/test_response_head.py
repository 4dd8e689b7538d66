"""Response heads read strictly, and the body framing and reuse they imply."""

from __future__ import annotations

import pytest

from router.engine.response_head import CHUNKED, LENGTH, TO_CLOSE, HeadError, body_framing, parse_head


def test_a_status_line_and_headers_are_read() -> None:
    status, reason, headers, http11 = parse_head(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\nX-A:  b ")
    assert (status, reason, http11) == (404, b"Not Found", True)
    assert headers == [(b"content-length", b"3"), (b"x-a", b"b")]


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/2 200 OK",
        b"HTTP/1.1 20 OK",
        b"HTTP/1.1 2000 OK",
        b"ICY 200 OK",
        b"HTTP/1.1 200 OK\r\n folded: header",
        b"HTTP/1.1 200 OK\r\nno-colon",
        b"HTTP/1.1 200 OK\r\nspace before : colon",
        b"HTTP/1.1 200 OK\r\nbare\nlf: x",
    ],
)
def test_a_malformed_head_is_refused(head: bytes) -> None:
    with pytest.raises(HeadError):
        parse_head(head)


def test_framing_follows_the_headers() -> None:
    assert body_framing(200, [(b"transfer-encoding", b"Chunked")], True) == (CHUNKED, 0, True)
    assert body_framing(200, [(b"content-length", b"12")], True) == (LENGTH, 12, True)
    assert body_framing(200, [], True) == (TO_CLOSE, 0, False)
    assert body_framing(200, [(b"content-length", b"1"), (b"connection", b"close")], True) == (LENGTH, 1, False)
    assert body_framing(200, [(b"content-length", b"1")], False) == (LENGTH, 1, False)  # HTTP/1.0
    assert body_framing(204, [], True) == (LENGTH, 0, True)
    # Both: chunked wins, and the connection is not reused.
    assert body_framing(200, [(b"transfer-encoding", b"chunked"), (b"content-length", b"5")], True) == (
        CHUNKED,
        0,
        False,
    )


@pytest.mark.parametrize(
    "headers",
    [
        [(b"transfer-encoding", b"gzip, chunked")],
        [(b"content-length", b"1"), (b"content-length", b"2")],
        [(b"content-length", b"-1")],
    ],
)
def test_unreadable_framing_is_refused(headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(HeadError):
        body_framing(200, headers, True)
