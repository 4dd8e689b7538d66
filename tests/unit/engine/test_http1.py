"""The hand-written HTTP/1.1 connection: response heads read strictly, bodies de-chunked at
any split, SSE events handed over, flow control, and when a connection may be reused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.engine.errors import BROKEN, PROTOCOL, TOO_LARGE
from router.engine.http1 import HOLD_BYTES, LEADING_CHUNKS, LegConnection


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.paused = False
        self.closed = False

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class FakePool:
    def __init__(self) -> None:
        self.released: list[LegConnection] = []
        self.drained: list[LegConnection] = []
        self.forgotten: list[LegConnection] = []

    def release(self, conn: LegConnection) -> None:
        self.released.append(conn)

    def draining(self, conn: LegConnection) -> None:
        self.drained.append(conn)

    def forget(self, conn: LegConnection) -> None:
        self.forgotten.append(conn)


def connection(read_limit: int = 1 << 20) -> tuple[LegConnection, FakeTransport, FakePool]:
    pool = FakePool()
    conn = LegConnection(pool, ("h", 1), read_limit)  # type: ignore[arg-type]
    transport = FakeTransport()
    conn.connection_made(transport)
    conn.send(b"POST / HTTP/1.1\r\n\r\n")
    return conn, transport, pool


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def sse_body() -> bytes:
    events = [b'data: {"n":%d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]
    return b"".join(chunk(e) for e in events) + b"0\r\n\r\n"


@pytest.mark.parametrize("split", [1, 2, 3, 5, 7, 13, 64, 10_000])
async def test_a_chunked_stream_reads_the_same_at_any_split(split: int) -> None:
    conn, _, pool = connection()
    data = CHUNKED_HEAD + sse_body()
    for i in range(0, len(data), split):
        conn.data_received(data[i : i + split])
    assert conn.status == 200
    assert list(conn.events) == [b'{"n":0}', b'{"n":1}', b'{"n":2}', b"[DONE]"]
    assert conn.body_done
    assert conn.keep_alive
    conn.release()
    assert pool.released == [conn]


@pytest.mark.parametrize("read", [3, 17, 64, 500, 4096])
async def test_a_backlog_read_in_pieces_reads_as_one_read(read: int) -> None:
    # Reads that begin and end inside chunks, whole chunks between them, and chunks of
    # other kinds (an extension, CRLF lines) among them.
    events = [b'data: {"n":%d}\n\n' % i for i in range(120)]
    odd = b"c;x=1\r\n" + b"data: {}\r\n\r\n" + b"\r\n"
    body = b"".join(map(chunk, events[:60])) + odd + b"".join(map(chunk, events[60:]))
    body += chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    expected = [b'{"n":%d}' % i for i in range(60)] + [b"{}"] + [b'{"n":%d}' % i for i in range(60, 120)] + [b"[DONE]"]
    conn, _, _ = connection()
    data = CHUNKED_HEAD + body
    for i in range(0, len(data), read):
        conn.data_received(data[i : i + read])
    conn.wait()  # a first read's rest past its leading chunks is read when the reader asks
    assert list(conn.events) == expected
    assert conn.body_done
    assert conn.keep_alive


async def test_chunk_extensions_and_trailers_are_skipped() -> None:
    conn, _, _ = connection()
    body = b'f;name=value\r\ndata: {"a":1}\n\n\r\n0\r\nx-trailer: 1\r\n\r\n'
    conn.data_received(CHUNKED_HEAD + chunk(b"data: 0\n\n") + body)
    assert list(conn.events) == [b"0", b'{"a":1}']
    assert conn.body_done


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\ndata: x\n\n\r\n",
        b"3\r\nabcXY",
        b"-3\r\nabc\r\n",
        b"0x3\r\nabc\r\n",
        b"f" * 5000,
        chunk(b"data: 0\n\n") + b"4\r\ndata: x\n\n\r\n",  # a plain chunk's size not its payload's
    ],
)
async def test_a_bad_chunk_breaks_the_connection(body: bytes) -> None:
    conn, transport, _ = connection()
    conn.data_received(CHUNKED_HEAD + body)
    assert conn.failure is not None
    assert conn.failure[0] == PROTOCOL
    assert transport.closed


async def test_a_content_length_body_ends_at_its_length() -> None:
    conn, _, _ = connection()
    body = b"data: {}\n\ndata: [DONE]\n\n"
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5])
    assert not conn.body_done
    conn.data_received(body[5:])
    assert conn.body_done
    assert list(conn.events) == [b"{}", b"[DONE]"]


async def test_a_body_read_to_close_ends_when_the_engine_closes() -> None:
    conn, _, pool = connection()
    conn.data_received(b"HTTP/1.1 200 OK\r\n\r\ndata: {}\n\n")
    assert not conn.body_done
    conn.connection_lost(None)
    assert conn.body_done
    assert list(conn.events) == [b"{}"]
    assert pool.forgotten == [conn]


async def test_a_connection_lost_mid_body_is_a_broken_leg() -> None:
    conn, _, _ = connection()
    conn.data_received(CHUNKED_HEAD + chunk(b"data: {}\n\n"))
    waiter = conn.wait()
    conn.connection_lost(ConnectionResetError())
    assert waiter.done()
    assert conn.failure is not None
    assert conn.failure[0] == BROKEN


async def test_an_interim_answer_is_skipped() -> None:
    conn, _, _ = connection()
    conn.data_received(b"HTTP/1.1 100 Continue\r\n\r\n" + CHUNKED_HEAD + chunk(b"data: 1\n\n"))
    assert conn.status == 200
    assert list(conn.events) == [b"1"]


async def test_an_error_answer_is_kept_as_bytes() -> None:
    conn, _, _ = connection()
    conn.data_received(b'HTTP/1.1 400 Bad Request\r\nContent-Length: 7\r\n\r\n{"a":1}')
    assert conn.status == 400
    assert conn.raw == bytearray(b'{"a":1}')
    assert conn.body_done
    assert not conn.events


@pytest.mark.parametrize("split", [1, 3, 7, 64, 10_000])
async def test_a_whole_answer_is_kept_as_bytes_at_any_split(split: int) -> None:
    # A non-streamed answer (send(..., whole=N)): the body is not read as SSE but kept whole.
    conn, _, pool = connection()
    conn.send(b"POST /tokenize HTTP/1.1\r\n\r\n", whole=100)
    body = b'{"tokens":[1,2,3]}'
    data = CHUNKED_HEAD + chunk(body[:4]) + chunk(body[4:]) + b"0\r\n\r\n"
    for i in range(0, len(data), split):
        conn.data_received(data[i : i + split])
    assert conn.raw == bytearray(body)
    assert conn.body_done
    assert conn.failure is None
    assert not conn.events
    conn.release()
    assert pool.released == [conn]
    assert conn.raw is None  # the next request of the pooled connection starts clean


async def test_a_whole_answer_past_its_bound_closes_the_connection() -> None:
    conn, transport, _ = connection()
    conn.send(b"POST / HTTP/1.1\r\n\r\n", whole=8)
    conn.data_received(CHUNKED_HEAD + chunk(b"x" * 5))
    assert conn.failure is None
    conn.data_received(chunk(b"x" * 5))
    assert conn.failure is not None
    assert conn.failure[0] == TOO_LARGE
    assert transport.closed


async def test_the_reader_is_woken_only_by_whole_events() -> None:
    conn, _, _ = connection()
    conn.data_received(CHUNKED_HEAD)
    waiter = conn.wait()
    conn.data_received(chunk(b"data: {"))
    assert not waiter.done()
    conn.data_received(chunk(b"}\n\n"))
    assert waiter.done()
    assert list(conn.events) == [b"{}"]


async def test_reading_pauses_past_the_bound_and_resumes_when_the_reader_waits() -> None:
    conn, transport, _ = connection(read_limit=100)
    conn.data_received(CHUNKED_HEAD + chunk(b"data: " + b"x" * 60 + b"\n\n"))
    assert not transport.paused
    conn.data_received(chunk(b"data: " + b"y" * 60 + b"\n\n"))
    assert transport.paused
    conn.events.clear()  # the reader took everything
    conn.wait()
    assert not transport.paused


async def test_a_connection_paused_by_the_reads_that_ended_its_body_is_pooled_reading() -> None:
    # The answer's last read took it past the bound and ended it: the reader takes the
    # events and releases the connection without waiting again.
    conn, transport, pool = connection(read_limit=100)
    conn.data_received(
        CHUNKED_HEAD + chunk(b"data: " + b"x" * 200 + b"\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    )
    assert transport.paused
    assert conn.body_done
    conn.events.clear()
    conn.release()
    assert pool.released == [conn]
    assert not transport.paused
    conn.send(b"POST / HTTP/1.1\r\n\r\n")  # the next answer on it is heard
    conn.data_received(CHUNKED_HEAD + chunk(b"data: {}\n\n"))
    assert list(conn.events) == [b"{}"]


async def test_finished_before_the_last_chunk_the_connection_is_pooled_at_the_body_end() -> None:
    conn, transport, pool = connection()
    conn.data_received(CHUNKED_HEAD + chunk(b"data: [DONE]\n\n"))
    conn.release()
    assert pool.drained == [conn]
    assert not pool.released
    conn.data_received(b"0\r\n\r\n")
    assert pool.released == [conn]
    assert not transport.closed


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nextra",
    ],
)
async def test_a_connection_the_engine_will_not_reuse_is_closed(head: bytes) -> None:
    conn, transport, pool = connection()
    conn.data_received(head)
    conn.release()
    assert transport.closed
    assert not pool.released


async def test_bytes_on_an_idle_connection_close_it() -> None:
    conn, transport, _ = connection()
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    conn.release()
    conn.data_received(b"HTTP/1.1 200 OK\r\n")
    assert transport.closed


async def test_events_arriving_while_the_reader_waits_go_to_the_direct_callback_first() -> None:
    conn, _, pool = connection()
    conn.data_received(CHUNKED_HEAD + chunk(b"data: 0\n\n"))
    assert list(conn.events) == [b"0"]
    conn.events.clear()
    offered: list[list[bytes]] = []

    def take_digits(events: Any) -> bool:
        offered.append(list(events))
        while events and events[0].isdigit():
            events.popleft()
        return not events

    conn.direct = take_digits
    conn.data_received(chunk(b"data: 1\n\n"))  # nobody waits: left for the reader
    assert offered == []
    assert list(conn.events) == [b"1"]
    conn.events.clear()
    waiter = conn.wait()
    conn.data_received(chunk(b"data: 2\n\ndata: 3\n\n"))
    assert offered == [[b"2", b"3"]]
    assert not waiter.done()  # all taken: the reader sleeps on
    assert not conn.events
    conn.data_received(chunk(b"data: 4\n\ndata: x\n\n"))
    assert waiter.done()  # the rest wakes it
    assert list(conn.events) == [b"x"]
    conn.data_received(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    conn.release()
    assert conn.direct is None  # a pooled connection's next request starts without it
    assert pool.released == [conn]


async def test_a_reader_woken_but_not_yet_run_keeps_the_order_of_events() -> None:
    conn, _, _ = connection()
    conn.data_received(CHUNKED_HEAD)

    def take_all(events: Any) -> bool:
        events.clear()
        return True

    conn.direct = take_all
    waiter = conn.wait()
    waiter.set_result(None)  # woken, its task not yet run: nothing may overtake what it reads
    conn.data_received(chunk(b"data: 5\n\n"))
    assert list(conn.events) == [b"5"]


def long_answer(events: int = HOLD_BYTES // 50) -> tuple[bytes, list[bytes]]:
    """An answer whose body is well past `HOLD_BYTES` (held past its first chunks), and its events."""
    payloads = [b'{"token":%d,"text":"%s"}' % (i, b"w" * 60) for i in range(events)] + [b"[DONE]"]
    body = b"".join(chunk(b"data: " + p + b"\n\n") for p in payloads) + b"0\r\n\r\n"
    return body, payloads


async def test_an_answer_read_at_once_is_read_to_its_first_chunks_the_rest_when_asked() -> None:
    conn, _, _ = connection()
    body, payloads = long_answer()
    conn.data_received(CHUNKED_HEAD + body)
    assert list(conn.events) == payloads[:LEADING_CHUNKS]
    conn.events.clear()
    assert conn.wait().done()
    assert list(conn.events) == payloads[LEADING_CHUNKS:]
    assert conn.body_done


@pytest.mark.parametrize("taken_first", [True, False])
async def test_the_held_rest_is_offered_on_its_bytes_once_every_event_before_it_was_taken(taken_first: bool) -> None:
    conn, _, _ = connection()
    body, payloads = long_answer()
    conn.data_received(CHUNKED_HEAD + body)
    if taken_first:
        conn.events.clear()
    offered: list[bytes] = []

    def take_three(data: bytes) -> int:
        offered.append(data)
        pos = 0
        for _ in range(3):
            size, _, _ = data[pos:].partition(b"\r\n")
            pos += len(size) + 2 + int(size, 16) + 2
        return pos

    conn.read_held(take_three)
    lead = b"".join(chunk(b"data: " + p + b"\n\n") for p in payloads[:LEADING_CHUNKS])
    assert offered == ([body[len(lead) :]] if taken_first else [])
    assert list(conn.events) == (payloads[LEADING_CHUNKS + 3 :] if taken_first else payloads)
    assert conn.body_done
    assert not conn.held


async def test_a_read_after_a_held_rest_comes_after_it() -> None:
    conn, _, _ = connection()
    body, payloads = long_answer()
    cut = body.index(b"[DONE]") - 10
    conn.data_received(CHUNKED_HEAD + body[:cut])
    conn.data_received(body[cut:])
    assert list(conn.events) == payloads
    assert conn.body_done


async def test_released_while_holding_the_body_s_end_the_connection_is_pooled() -> None:
    conn, transport, pool = connection()
    conn.data_received(CHUNKED_HEAD + long_answer()[0])
    conn.release()
    assert (pool.released, pool.drained, transport.closed) == ([conn], [], False)


async def test_a_held_whole_answer_then_the_engine_s_close_is_not_a_broken_leg() -> None:
    conn, _, _ = connection()
    body, payloads = long_answer()
    conn.data_received(CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n") + body)
    conn.connection_lost(None)
    # the body's own end (its mark is read only where no [DONE] came), not a lost connection
    assert conn.failure == (BROKEN, "stream ended without [DONE]")
    assert list(conn.events) == payloads
