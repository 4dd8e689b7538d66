"""SSE framing (router/engine/sse.py): chunk boundaries anywhere, line-end styles, comments,
flush; format_event."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.engine.sse import DONE_EVENT, KEEPALIVE_EVENT, SSEDecoder, SSEError, format_event


def decode_all(chunks: list[bytes]) -> list[bytes]:
    d = SSEDecoder()
    out: list[bytes] = []
    for c in chunks:
        out.extend(d.feed(c))
    out.extend(d.flush())
    return out


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted({c for c in cuts if 0 < c < len(data)})
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def test_vllm_shaped_stream() -> None:
    stream = (
        format_event({"id": "cmpl-1", "choices": [{"text": "a"}]})
        + KEEPALIVE_EVENT
        + format_event({"id": "cmpl-1", "choices": []})
        + DONE_EVENT
    )
    out = decode_all([stream])
    assert [orjson.loads(p) for p in out[:2]] == [
        {"id": "cmpl-1", "choices": [{"text": "a"}]},
        {"id": "cmpl-1", "choices": []},
    ]
    assert out[2] == b"[DONE]"


def test_format_event_is_one_data_line() -> None:
    ev = format_event({"text": "line1\nline2\r\n"})
    assert ev.startswith(b"data: ")
    assert ev.endswith(b"\n\n")
    assert ev.count(b"\n") == 2


def test_crlf_and_cr_line_ends() -> None:
    for sep in (b"\r\n", b"\r", b"\n"):
        data = b"data: one" + sep + sep + b"data: two" + sep + b"data: three" + sep + sep
        assert decode_all([data]) == [b"one", b"two\nthree"]


def test_cr_then_lf_split_across_feeds_is_one_line_end() -> None:
    d = SSEDecoder()
    assert d.feed(b"data: x\r") == []
    assert d.feed(b"\n\r") == [b"x"]
    assert d.feed(b"\ndata: y\r\n\r\n") == [b"y"]


def test_field_forms() -> None:
    data = (
        b"data:nospace\n\n"  # no space after the colon
        b"data:  two spaces\n\n"  # only one space is removed
        b"data\n\n"  # a field name alone: empty data
        b"data:\n\n"
        b"event: message\nid: 7\nretry: 10\ndata: x\n\n"
        b": comment\n\n"  # comment only: no event
        b"event: ping\n\n"  # no data line: no event
        b"foo: bar\ndata: y\n\n"
    )
    assert decode_all([data]) == [b"nospace", b" two spaces", b"", b"", b"x", b"y"]


def test_flush_returns_unterminated_event_and_line() -> None:
    d = SSEDecoder()
    assert d.feed(b"data: a\n\ndata: b\n") == [b"a"]
    assert d.flush() == [b"b"]
    d2 = SSEDecoder()
    assert d2.feed(b"data: [DONE]") == []
    assert d2.flush() == [b"[DONE]"]
    assert d2.flush() == []


def test_empty_feeds_and_memoryview() -> None:
    d = SSEDecoder()
    assert d.feed(b"") == []
    assert d.feed(memoryview(b"data: m\n")) == []
    assert d.feed(bytearray(b"\n")) == [b"m"]
    assert d.feed(memoryview(b"data: n\n\n")) == [b"n"]


def test_unbounded_line_is_an_error() -> None:
    d = SSEDecoder(max_line_bytes=16)
    with pytest.raises(SSEError):
        d.feed(b"data: " + b"x" * 32)


def test_unbounded_line_in_pieces_is_an_error() -> None:
    d = SSEDecoder(max_line_bytes=16)
    d.feed(b"data: xxxx")
    with pytest.raises(SSEError):
        d.feed(b"x" * 16)


def test_a_long_line_in_many_reads_is_scanned_once() -> None:
    """A chunk of megabytes arrives in many reads: each byte is looked at a bounded number
    of times (joining and rescanning the carried line at every read made this quadratic:
    seconds of CPU for a 16 MiB chunk)."""
    payload = b'{"text":"' + b"x" * (1 << 20) + b'"}'
    event = b"data: " + payload + b"\n\n"
    d = SSEDecoder()
    out: list[bytes] = []
    pieces = split_at(event, list(range(4096, len(event), 4096)))
    for piece in pieces:
        out.extend(d.feed(piece))
    assert out == [payload]
    assert d.scanned_bytes <= len(event)


# Payloads as JSON encodes them: no raw CR/LF (orjson escapes them), any other text.
payload_st = st.one_of(
    st.just(b"[DONE]"),
    st.dictionaries(
        st.text(max_size=5), st.one_of(st.text(max_size=20), st.integers(-(2**63), 2**63 - 1)), max_size=4
    ).map(orjson.dumps),
)


sep_st = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A valid stream (payloads, comments, keep-alives; each event in one line-end style,
    since a lone \r followed by \n would be one CRLF line end) with its payloads."""
    payloads = draw(st.lists(payload_st, max_size=8))
    parts: list[bytes] = []
    for p in payloads:
        if draw(st.booleans()):
            s = draw(sep_st)
            parts.append(b": keep-alive" + s + s)
        s = draw(sep_st)
        # Multi-line data: split the payload at a random point into two data lines.
        if len(p) > 1 and draw(st.booleans()):
            k = draw(st.integers(1, len(p) - 1))
            # "data:" takes one optional space after the colon (WHATWG): a second line
            # whose text starts with a space needs the separator space written out.
            second = b"data: " if p[k : k + 1] == b" " else b"data:"
            parts.append(b"data: " + p[:k] + s + second + p[k:] + s + s)
            continue
        parts.append(b"data: " + p + s + s)
    return b"".join(parts), payloads


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.lists(st.integers(0, 2000), max_size=20))
def test_any_split_yields_the_same_payloads(stream: tuple[bytes, list[bytes]], cuts: list[int]) -> None:
    data, payloads = stream
    whole = decode_all([data])
    # Multi-line events come back joined with \n at the split point.
    assert len(whole) == len(payloads)
    assert decode_all(split_at(data, cuts)) == whole


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_byte_by_byte_equals_whole(stream: tuple[bytes, list[bytes]]) -> None:
    data, payloads = stream
    whole = decode_all([data])
    assert decode_all([data[i : i + 1] for i in range(len(data))]) == whole
    # Events without multi-line data decode to exactly the payloads sent.
    for got, sent in zip(whole, payloads, strict=False):
        assert got.replace(b"\n", b"") == sent


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=10))
def test_arbitrary_bytes_never_crash_and_split_invariant(data: bytes, cuts: list[int]) -> None:
    assert decode_all(split_at(data, cuts)) == decode_all([data])


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(payload_st, max_size=6))
def test_format_then_decode_roundtrip(payloads: list[bytes]) -> None:
    objs = [orjson.loads(p) for p in payloads if p != b"[DONE]"]
    data = b"".join(format_event(o) for o in objs) + DONE_EVENT
    out = decode_all([data])
    assert [orjson.loads(p) for p in out[:-1]] == objs
    assert out[-1] == b"[DONE]"


def test_whole_event_reads_with_odd_content() -> None:
    # Reads that end on an event boundary take the fast path; odd events inside still follow
    # the general rules.
    d = SSEDecoder()
    assert d.feed(b"\n\ndata: a\n\n\n\n: c\n\ndata: b1\ndata: b2\n\nevent: x\n\ndata:c\n\n") == [b"a", b"b1\nb2", b"c"]
    assert d.feed(b"data: d\n") == []  # partial: general path from here
    assert d.feed(b"\n") == [b"d"]
    assert d.feed(b"data: e\n\n") == [b"e"]  # back on the fast path


@pytest.mark.parametrize(
    "data",
    [
        b"data: a\n\ndata: \n\ndata: [DONE]\n\n",  # an empty payload
        b"data: data: x\n\ndata:  y\n\n",  # the prefix inside a payload; a second space kept
        b"data: a\n\n: keep-alive\n\ndata: b\n\n",  # a comment between two events
        b"data: a\n\nid: 1\n\n",  # an event without data
        b"data: a\ndata: b\n\n",  # two data lines, one event
        b"data:a\n\ndata: b\n\n",  # no space after the colon
        b"event: x\ndata: a\n\n",  # another field before the data
        b"data: a\n\n\n\ndata: b\n\n",  # a stray blank line
    ],
)
def test_whole_events_split_at_once_read_as_line_by_line(data: bytes) -> None:
    assert SSEDecoder().feed(data) == decode_all([data[i : i + 1] for i in range(len(data))])


@pytest.mark.parametrize("read", [1, 2, 7, 13, 64, 1000])
def test_a_backlog_in_reads_of_a_fixed_size_reads_as_one_read(read: int) -> None:
    # Reads that begin and end inside events, with whole events between them.
    events = [format_event({"choices": [{"text": "x" * (i % 9)}]}) for i in range(40)]
    stream = b"".join(events[:20]) + KEEPALIVE_EVENT + b"data: a\ndata: b\n\n" + b"".join(events[20:]) + DONE_EVENT
    assert decode_all([stream[i : i + read] for i in range(0, len(stream), read)]) == decode_all([stream])
    assert len(decode_all([stream])) == 42
