"""One leg's chunks to the client (router/dispatch/pump.py): `pump_raw` sends what `pump` sends,
token chunks on their bytes, one write per batch received together; a chunk it cannot read
or a token past the budget ends the leg in an error after the chunks before it went out."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import orjson
import pytest

from router.admission.spec import parse_request
from router.answer.progress import TokenIds
from router.answer.shaper import ResponseShaper
from router.dispatch.context import Leg, RequestContext
from router.dispatch.pump import pump, pump_raw
from router.engine.chunked import ChunkedBody
from router.engine.errors import PROTOCOL, UpstreamError
from router.engine.sse import SSEDecoder, format_event
from router.engine.stream import UpstreamStream
from router.observability.record import RequestRecord
from router.routing.planning import RouteQuery
from support.fake_upstream import answer, token, usage


class ScriptedStream:
    """A leg's stream: batches of event payloads, as `next_payloads` / `next_chunks` give them.
    Once the pump relays from reads, each batch is offered to its relay first, as the
    connection's read callback offers what arrives while the pump waits."""

    def __init__(self, batches: list[list[bytes]], ready: list[bytes] | None = None) -> None:
        self.batches = list(batches)
        self.ready = list(ready or [])  # already received when the pump starts
        self.ended = ""
        self.relay: Callable[[deque[bytes]], bool] | None = None
        self.relayed = 0  # events the relay took
        self.offers = True  # False: a source that cannot relay from its reads
        # True: each batch is first offered as the read of a chunked body that holds it
        # (one event a chunk), as the hand-written connection offers it.
        self.chunked = False
        self.relay_chunked: Callable[[bytes], tuple[int, int]] | None = None
        self.relayed_chunked = 0  # events the chunked relay took
        # The rest of an answer read at once, held by the connection past its first chunks.
        self.held: list[bytes] = []
        self.held_taken = 0  # of them, the chunks `take_held`'s shape took on their bytes

    def relay_from_reads(
        self,
        relay: Callable[[deque[bytes]], bool] | None,
        relay_chunked: Callable[[bytes], tuple[int, int]] | None = None,
    ) -> None:
        self.relay, self.relay_chunked = relay, relay_chunked

    @property
    def done(self) -> bool:  # [DONE] comes with the last batch
        return not self.batches and not self.held

    @property
    def holds_bytes(self) -> bool:
        return bool(self.held)

    def take_held(self, shape: Callable[[bytes], tuple[bytes, int, int] | None]) -> bytes:
        read = chunked_read(self.held)
        self.held = []
        shaped = shape(read)
        made, taken, n = shaped if shaped is not None else (b"", 0, 0)
        self.held_taken += n
        self.ready += SSEDecoder().feed(ChunkedBody().feed(read[taken:]))
        return made

    def ready_payloads(self) -> list[bytes]:
        out, self.ready = self.ready, []
        return out

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    async def next_payloads(self) -> list[bytes]:
        while self.batches:
            batch = self.batches.pop(0)
            if self.relay is None or not self.offers:
                return batch
            if self.chunked and self.relay_chunked is not None:
                read = chunked_read(batch)
                taken, n = self.relay_chunked(read)
                rest = ChunkedBody().feed(read[taken:])
                assert (taken == 0) == (n == 0)
                self.relayed_chunked += n
                batch = SSEDecoder().feed(rest)
                if not batch:
                    continue
            events = deque(batch)
            took_all = self.relay(events)
            self.relayed += len(batch) - len(events)
            if not took_all:
                return list(events)
        return []

    async def next_chunks(self) -> list[dict[str, Any]]:
        return [self.parse(p) for p in await self.next_payloads()]

    def parse(self, payload: bytes) -> dict[str, Any]:
        try:
            return cast("dict[str, Any]", orjson.loads(payload))
        except orjson.JSONDecodeError:
            raise UpstreamError("e", PROTOCOL, "unparseable chunk") from None

    def abort(self) -> None:
        self.ended = "aborted"

    def finish(self) -> None:
        self.ended = "finished"


def chunked_read(payloads: list[bytes]) -> bytes:
    """The payloads as uvicorn writes them: an SSE event a chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p) + 8, b"data: " + p + b"\n\n") for p in payloads)


def setup(
    batches: list[list[bytes]],
    max_tokens: int = 16,
    buffered: list[dict[str, Any]] | None = None,
    ready: list[bytes] | None = None,
    stream: bool = True,
) -> tuple[ResponseShaper, RequestContext, Leg, ScriptedStream]:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": max_tokens, "stream": stream}
    spec = replace(parse_request("completions", orjson.dumps(body)), request_id="cmpl-fixed", created=7)
    shaper = ResponseShaper(spec)
    shaper.begin_leg(is_resume=False)
    rec = RequestRecord(request_id=spec.request_id, endpoint="completions", model="m", stream=stream)
    ctx = RequestContext(RouteQuery("m", "x"), "/v1/completions", body, 0.0, 1e9, rec)
    scripted = ScriptedStream(batches, ready)
    return shaper, ctx, Leg("e", cast("UpstreamStream", scripted), buffered or [], "direct"), scripted


def words(n: int) -> list[bytes]:
    return [orjson.dumps(c) for c in answer([1, 2], [(f" w{i}", 100 + i) for i in range(n)])]


async def test_raw_pump_writes_what_the_parsing_pump_writes_one_write_per_batch() -> None:
    payloads = words(6)
    batches = [payloads[:1], payloads[1:5], payloads[5:]]
    shaper, ctx, leg, stream = setup(batches)
    writes: list[bytes] = []

    async def emit_raw(data: bytes, last: bool) -> None:
        writes.append(data)

    lasts: list[bool] = []

    async def emit_raw_last(data: bytes, last: bool) -> None:
        writes.append(data)
        lasts.append(last)

    outcome = await pump_raw(ctx, leg, shaper, emit_raw_last)
    assert outcome.error is None
    assert outcome.prompt_tokens == 2
    assert stream.ended == "finished"
    assert len(writes) == 2  # the finish chunk and usage are held or swallowed: no third write
    assert lasts == [False, False]  # the finish came in a batch of its own, which writes nothing
    raw_answer = list(shaper.answer.generated_token_ids)

    shaper, ctx, leg, _ = setup(batches)
    parsed: list[dict[str, Any]] = []

    async def emit(chunks: list[dict[str, Any]]) -> None:
        parsed.extend(chunks)

    await pump(ctx, leg, shaper, emit)
    assert b"".join(writes) == b"".join(map(format_event, parsed))
    assert raw_answer == list(shaper.answer.generated_token_ids) == [100, 101, 102, 103, 104, 105]
    assert ctx.record.ttft_s is not None


async def test_the_race_s_chunks_and_what_came_after_them_go_in_one_write() -> None:
    payloads = words(6)
    first = orjson.loads(payloads[0])
    shaper, ctx, leg, _ = setup([payloads[4:]], buffered=[first], ready=payloads[1:4])
    writes: list[tuple[bytes, bool]] = []

    async def emit_raw(data: bytes, last: bool) -> None:
        writes.append((data, last))

    outcome = await pump_raw(ctx, leg, shaper, emit_raw)
    assert outcome.error is None
    assert [(d.count(b"data: "), last) for d, last in writes] == [
        (4, False),
        (1, True),
    ]  # w5 (with the finish) comes with the end
    assert list(shaper.answer.generated_token_ids) == [100, 101, 102, 103, 104, 105]


async def test_an_unreadable_chunk_ends_the_leg_after_the_chunks_before_it() -> None:
    payloads = words(4)
    shaper, ctx, leg, stream = setup([[*payloads[:3], b"{not json", payloads[3]]])
    writes: list[bytes] = []

    async def emit_raw(data: bytes, last: bool) -> None:
        writes.append(data)

    outcome = await pump_raw(ctx, leg, shaper, emit_raw)
    assert outcome.error is not None
    assert outcome.error.kind == PROTOCOL
    assert stream.ended == "aborted"
    assert b"".join(writes).count(b"data: ") == 3
    assert list(shaper.answer.generated_token_ids) == [100, 101, 102]


async def test_a_token_past_the_budget_is_not_sent_and_fails_the_leg() -> None:
    chunks = [token(f" w{i}", [100 + i], prompt_ids=[1, 2] if i == 0 else None) for i in range(6)]
    payloads = [orjson.dumps(c) for c in [*chunks, usage(2, 6)]]
    shaper, ctx, leg, stream = setup([payloads], max_tokens=4)
    writes: list[bytes] = []

    async def emit_raw(data: bytes, last: bool) -> None:
        writes.append(data)

    outcome = await pump_raw(ctx, leg, shaper, emit_raw)
    assert outcome.error is not None
    assert "max_tokens" in outcome.error.detail
    assert b"".join(writes).count(b"data: ") == 4
    assert len(shaper.answer.generated_token_ids) == 4
    assert stream.ended == "aborted"


async def test_the_plain_chunks_of_a_batch_go_as_one_run_read_only_when_asked() -> None:
    payloads = words(8)
    shaper, ctx, leg, _ = setup([payloads])
    writes: list[bytes] = []

    async def emit_raw(data: bytes, last: bool) -> None:
        writes.append(data)

    outcome = await pump_raw(ctx, leg, shaper, emit_raw)
    assert outcome.error is None
    assert type(shaper.answer.generated_token_ids) is TokenIds  # the run's bytes, not read yet
    assert len(shaper.answer.generated_token_ids) == 8
    assert list(shaper.answer.generated_token_ids) == [100 + i for i in range(8)]
    assert shaper.answer.generated_text == "".join(f" w{i}" for i in range(8))

    shaper, ctx, leg, _ = setup([payloads])
    parsed: list[dict[str, Any]] = []

    async def emit(chunks: list[dict[str, Any]]) -> None:
        parsed.extend(chunks)

    await pump(ctx, leg, shaper, emit)
    assert b"".join(writes) == b"".join(map(format_event, parsed))


class ClientLog:
    """The client's stream: what the pump writes (`emit`) and what goes from the read
    callback (`write_now`), in the order written."""

    def __init__(self, ready: bool = True) -> None:
        self.writes: list[tuple[str, bytes]] = []
        self.is_ready = ready

    async def emit(self, data: bytes, last: bool) -> None:
        self.writes.append(("pump", data))

    def ready(self) -> bool:
        return self.is_ready

    def write_now(self, data: bytes) -> None:
        self.writes.append(("callback", data))

    def sent(self, by: str | None = None) -> bytes:
        return b"".join(data for who, data in self.writes if by is None or who == by)


async def parsed_answer(batches: list[list[bytes]], max_tokens: int = 16) -> bytes:
    shaper, ctx, leg, _ = setup(batches, max_tokens=max_tokens)
    parsed: list[dict[str, Any]] = []

    async def emit(chunks: list[dict[str, Any]]) -> None:
        parsed.extend(chunks)

    await pump(ctx, leg, shaper, emit)
    return b"".join(map(format_event, parsed))


async def test_token_chunks_that_arrive_while_the_pump_waits_go_from_the_read_callback() -> None:
    payloads = words(6)
    batches = [payloads[:1], payloads[1:2], payloads[2:4], payloads[4:5], payloads[5:]]
    shaper, ctx, leg, stream = setup(batches)
    client = ClientLog()
    outcome = await pump_raw(ctx, leg, shaper, client.emit, direct=client)
    assert outcome.error is None
    assert stream.relayed == 4  # w1 .. w4; the first token's batch and the finish's go through the pump
    assert client.sent("callback").count(b"data: ") == 4
    assert client.sent() == await parsed_answer(batches)
    assert list(shaper.answer.generated_token_ids) == [100, 101, 102, 103, 104, 105]
    assert shaper.answer.generated_text == "".join(f" w{i}" for i in range(6))


async def test_token_chunks_of_a_chunked_read_go_from_the_read_callback_on_its_bytes() -> None:
    payloads = words(8)
    batches = [payloads[:1], payloads[1:2], payloads[2:5], payloads[5:]]
    shaper, ctx, leg, stream = setup(batches)
    stream.chunked = True
    client = ClientLog()
    outcome = await pump_raw(ctx, leg, shaper, client.emit, direct=client)
    assert outcome.error is None
    # w1 .. w6 on their bytes (the last read's two before its finish and usage, which are
    # read the usual way); the first token's batch goes through the pump.
    assert (stream.relayed_chunked, stream.relayed) == (6, 0)
    assert client.sent() == await parsed_answer(batches)
    assert list(shaper.answer.generated_token_ids) == [100 + i for i in range(8)]
    assert shaper.answer.generated_text == "".join(f" w{i}" for i in range(8))


@pytest.mark.parametrize("stream", [True, False])
async def test_an_answer_read_at_once_goes_in_one_write_its_token_chunks_on_their_bytes(stream: bool) -> None:
    payloads = words(12)
    shaper, ctx, leg, scripted = setup([payloads[:2]], stream=stream)
    scripted.held = payloads[2:]
    client = ClientLog()
    outcome = await pump_raw(ctx, leg, shaper, client.emit, direct=client if stream else None)
    assert outcome.error is None
    # w2 .. w10 on their bytes; w11 (the finish) and the usage chunk read the usual way
    assert scripted.held_taken == 9
    if stream:
        assert len(client.writes) == 1
        assert client.sent() == await parsed_answer([payloads])
    assert list(shaper.answer.generated_token_ids) == [100 + i for i in range(12)]
    assert shaper.answer.generated_text == "".join(f" w{i}" for i in range(12))
    assert shaper.answer.finish_reason == "stop"


async def test_a_client_whose_buffer_is_full_gets_its_chunks_from_the_pump() -> None:
    payloads = words(5)
    batches = [payloads[:1], payloads[1:2], payloads[2:3], payloads[3:]]
    shaper, ctx, leg, stream = setup(batches)
    client = ClientLog(ready=False)
    outcome = await pump_raw(ctx, leg, shaper, client.emit, direct=client)
    assert outcome.error is None
    assert stream.relayed == 0
    assert client.sent("callback") == b""
    assert client.sent() == await parsed_answer(batches)


async def test_a_token_past_the_budget_is_left_to_the_pump_which_fails_the_leg() -> None:
    chunks = [token(f" w{i}", [100 + i], prompt_ids=[1, 2] if i == 0 else None) for i in range(6)]
    payloads = [orjson.dumps(c) for c in [*chunks, usage(2, 6)]]
    batches = [[p] for p in payloads]
    shaper, ctx, leg, stream = setup(batches, max_tokens=4)
    client = ClientLog()
    outcome = await pump_raw(ctx, leg, shaper, client.emit, direct=client)
    assert outcome.error is not None
    assert "max_tokens" in outcome.error.detail
    assert stream.relayed == 3
    assert client.sent().count(b"data: ") == 4
    assert len(shaper.answer.generated_token_ids) == 4
    assert stream.ended == "aborted"


async def test_a_whole_answer_s_token_chunks_are_accumulated_from_the_read_callback() -> None:
    payloads = words(6)
    batches = [payloads[:1], payloads[1:3], payloads[3:5], payloads[5:]]
    bodies = []
    for offered in (True, False):  # a source that cannot relay (aiohttp's) wakes the pump for each
        shaper, ctx, leg, stream = setup(batches, stream=False)
        stream.offers = offered
        client = ClientLog()
        outcome = await pump_raw(ctx, leg, shaper, client.emit)  # no writer: nothing is written early
        assert outcome.error is None
        assert client.sent() == b""  # accumulated: nothing written before the end
        assert not [who for who, _ in client.writes if who == "callback"]
        assert stream.relayed == (4 if offered else 0)
        bodies.append(shaper.accumulate_response())
    assert bodies[0] == bodies[1]
    assert bodies[0]["choices"][0]["text"] == "".join(f" w{i}" for i in range(6))
