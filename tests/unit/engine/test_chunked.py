"""Chunked bodies: whole plain chunks read at once, everything else by the grammar, at
any split of the reads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.engine.chunked import ChunkedBody, ChunkError, leading_chunks, whole_chunks


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

    for count in (1, 2, 3):  # the first `count` chunks end where the grammar says, if whole and plain
        whole = len(reference) >= count
        assert leading_chunks(data, count) == (
            ([p for p, _ in reference[:count]], reference[count - 1][1]) if whole else ([], 0)
        )


def feed_in_pieces(body: bytes, cut: int) -> tuple[bytes, ChunkedBody]:
    reader = ChunkedBody()
    out = b"".join(reader.feed(body[i : i + cut]) for i in range(0, len(body), cut))
    return out, reader


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 64, 300, 4096, 1 << 20])
def test_a_body_reads_the_same_at_any_split_of_its_reads(cut: int) -> None:
    events = [b'data: {"n":%d,"pad":"%s"}\n\n' % (i, b"x" * (i * 37 % 500)) for i in range(40)]
    body = b"".join(map(chunk, events)) + b"3;ext=1\r\nabc\r\n0\r\nTrailer: x\r\n\r\n"
    out, reader = feed_in_pieces(body, cut)
    assert out == b"".join(events) + b"abc"
    assert reader.done
    assert not reader.past_end
    assert reader.between_chunks is False


def test_bytes_past_the_body_end_are_told() -> None:
    reader = ChunkedBody()
    assert reader.feed(chunk(b"abc") + b"0\r\n\r\nHTTP/1.1") == b"abc"
    assert reader.done
    assert reader.past_end


def test_the_chunk_a_read_ended_inside_is_told() -> None:
    reader = ChunkedBody()
    assert reader.between_chunks
    assert reader.inside_chunk == 0
    assert reader.feed(chunk(b"abcdef")[:5]) == b"ab"  # `6\r\nab`
    assert not reader.between_chunks
    assert reader.inside_chunk == 6
    assert reader.feed(b"cdef\r\n") == b"cdef"
    assert reader.between_chunks
    reader.feed(b"1")  # a size line cut by the read: not inside a chunk
    assert not reader.between_chunks
    assert reader.inside_chunk == 0


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b"3\r\nabcX\r\n", "bad chunk terminator"),
        (b"zz\r\nabc\r\n", "bad chunk size"),
        (b"-3\r\nabc\r\n", "bad chunk size"),
        (b"1" * 5000, "chunk-size line too long"),
    ],
)
def test_a_body_that_breaks_the_grammar_is_refused(body: bytes, detail: str) -> None:
    with pytest.raises(ChunkError, match=detail):
        ChunkedBody().feed(body)
