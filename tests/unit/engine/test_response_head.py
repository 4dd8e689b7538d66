"""Response heads read strictly, and the body framing and reuse they imply."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.engine.response_head import (
    CHUNKED,
    LENGTH,
    TO_CLOSE,
    HeadError,
    body_framing,
    parse_head,
    whole_chunks,
)


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


def chunk(payload: bytes, size: bytes | None = None) -> bytes:
    return (size if size is not None else b"%x" % len(payload)) + b"\r\n" + payload + b"\r\n"


def test_whole_plain_chunks_are_read_up_to_the_rest() -> None:
    events = [b'data: {"n":%d}\n\n' % i for i in range(3)]
    body = b"".join(map(chunk, events))
    assert whole_chunks(body) == (events, len(body))
    for rest in (b"0\r\n\r\n", b"1f\r\ndata: cut", b"1"):
        assert whole_chunks(body + rest) == (events, len(body))
    # One of another kind: left to the general rules, with those before it or not; a CR in
    # a payload the grammar allows, and a short read's loop reads it.
    assert whole_chunks(body + b"3;ext=1\r\nabc\r\n") in (None, (events, len(body)))
    cr = b"3\r\na\rb\r\n"
    assert whole_chunks(body + cr) in (None, (events, len(body)), ([*events, b"a\rb"], len(body + cr)))
    assert whole_chunks(chunk(b"data: xy\n\n", b"00A")) == ([b"data: xy\n\n"], 17)  # leading zeros, upper case


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"0\r\n\r\n",  # the last chunk: the general rules read it
        b"3;ext=1\r\nabc\r\n",
        b"x" + chunk(b"abc"),
        chunk(b"abc", b"4"),  # a size that is not its payload's
        chunk(b"abc") + chunk(b"abc", b"+3"),
    ],
)
def test_other_chunks_are_left_to_the_general_rules(body: bytes) -> None:
    assert whole_chunks(body) in (None, ([], 0), ([b"abc"], 8))


@pytest.mark.parametrize("pad", [0, 4096])
def test_a_payload_is_read_by_its_size_or_left_to_the_general_rules(pad: int) -> None:
    """A CR in a payload, or more than eight digits in a size: the grammar allows both, the
    split does not (the general rules read them); a short read's loop reads them."""
    long = chunk(b"x" * pad)
    for odd in (chunk(b"a\rb"), chunk(b"abc", b"000000003")):
        got = whole_chunks(odd + long)
        assert got is None or got[0][:1] == [odd[odd.index(b"\n") + 1 : -2]]


def read_chunks(data: bytes) -> list[tuple[bytes, int]]:
    """The reference: (payload, end) of each whole chunk `data` begins with, by the grammar."""
    out: list[tuple[bytes, int]] = []
    pos = 0
    while (end := data.find(b"\r\n", pos)) >= 0:
        size = data[pos:end]
        if not size or size.strip(b"0123456789abcdefABCDEF") or int(size, 16) == 0:
            break
        stop = end + 2 + int(size, 16)
        if data[stop : stop + 2] != b"\r\n":
            break
        out.append((data[end + 2 : stop], stop + 2))
        pos = stop + 2
    return out


sizes = st.sampled_from(["right", "upper", "wrong", "extension"])


# Payloads up to 600 bytes: reads shorter and longer than the split's threshold (2 KiB).
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=600), sizes), max_size=8), st.binary(max_size=12))
def test_whole_chunks_read_as_the_grammar_does(chunks: list[tuple[bytes, str]], tail: bytes) -> None:
    data = b""
    for payload, kind in chunks:
        size = b"%x" % len(payload)
        size = {"upper": size.upper(), "wrong": b"%x" % (len(payload) + 1), "extension": size + b";x"}.get(kind, size)
        data += chunk(payload, size)
    data += tail
    got = whole_chunks(data)
    reference = read_chunks(data)
    if got is not None:  # the chunks it read are the grammar's first ones
        payloads, rest = got
        assert payloads == [p for p, _ in reference[: len(payloads)]]
        assert rest == (reference[len(payloads) - 1][1] if payloads else 0)
    if not tail and chunks and all(kind in ("right", "upper") and b"\r" not in p for p, kind in chunks):
        assert got == ([p for p, _ in chunks], len(data))  # all plain: all read at once
