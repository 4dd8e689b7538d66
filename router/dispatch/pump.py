"""One leg's chunks to the client: from the leg's first chunk to its [DONE] or its failure.

`pump` hands the shaper parsed chunks and the client parsed chunks to encode (any writer,
e.g. another API's events); `pump_raw` is for the OpenAI SSE writer: a plain token chunk
goes to the client on its bytes (`ResponseShaper.shape_raw`, router/answer/chunk_bytes.py),
and only the chunks where something is decided are parsed. Both write everything already
received in one write, and end as a `LegOutcome` (the leg's error, or its usage figures).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from router.answer.chunk_bytes import looks_plain
from router.answer.shaper import ResponseShaper
from router.dispatch.context import Leg, LegOutcome, RequestContext
from router.engine.errors import PROTOCOL, UpstreamError
from router.engine.sse import format_event
from router.engine.wire import CACHE_THRESHOLD, MalformedChunk, message_usage
from router.fleet.stalls import STALL_LATE_S

Emit = Callable[[list[dict[str, Any]]], Awaitable[None]]
# The client's SSE events already encoded, one transport write per batch; the flag: the
# last of the answer, which may wait for the writer's finish (one write with [DONE]).
EmitRaw = Callable[[bytes, bool], Awaitable[None]]
# Told of a long wait for a leg's next piece: (backend, seconds) (router/fleet/stalls.py).
OnGap = Callable[[str, float], None]


class DirectWriter(Protocol):
    """The client's stream written from a callback, without awaiting: where plain token
    chunks go as they arrive (`UpstreamStream.relay_from_reads`)."""

    def ready(self) -> bool: ...  # a write now goes out at once (started, room in its buffer)

    def write_now(self, data: bytes) -> None: ...  # events written; only after `ready()`


async def pump(
    ctx: RequestContext, leg: Leg, shaper: ResponseShaper, emit: Emit, on_gap: OnGap | None = None
) -> LegOutcome:
    """The leg's chunks to the client until [DONE] or an upstream failure."""
    stream = leg.stream
    loop = stream.loop
    prompt_tokens = cached_tokens = None
    awaiting_first_token = ctx.record.ttft_s is None
    try:
        chunks = leg.buffered or await stream.next_chunks()
        while chunks:
            # Everything already received goes to the client in one write.
            batch: list[dict[str, Any]] = []
            bad: MalformedChunk | None = None
            for chunk in chunks:
                if chunk.get("usage"):
                    usage = message_usage(chunk)
                    prompt_tokens, cached_tokens = usage.prompt_tokens, usage.cached_tokens
                try:
                    batch += shaper.shape(chunk)
                except MalformedChunk as e:
                    bad = e
                    break
                if awaiting_first_token and shaper.answer.first_token_seen:
                    ctx.record_first_token(loop.time())
                    awaiting_first_token = False
            if batch:
                await emit(batch)
            if bad is not None:
                raise UpstreamError(leg.backend, PROTOCOL, f"unreadable chunk: {bad}") from None
            waiting_since = loop.time()
            chunks = await stream.next_chunks()
            if on_gap is not None and loop.time() - waiting_since > STALL_LATE_S:  # rare
                on_gap(leg.backend, loop.time() - waiting_since)
    except UpstreamError as e:
        stream.abort()
        return LegOutcome(e)
    except BaseException:
        stream.abort()
        raise
    stream.finish()
    return LegOutcome(None, prompt_tokens, cached_tokens)


async def pump_raw(
    ctx: RequestContext,
    leg: Leg,
    shaper: ResponseShaper,
    emit: EmitRaw,
    on_gap: OnGap | None = None,
    direct: DirectWriter | None = None,
) -> LegOutcome:
    """`pump` for a client written SSE bytes: token chunks go on their bytes, a run of them
    in one pass (`ResponseShaper.shape_run`); the chunks where something is decided (role,
    finish, usage, errors, anything unusual) are parsed. Once the answer's first token is
    out, plain token chunks are taken from the engine connection's read callback as they
    arrive (`relay_now`): a whole answer's accumulated, a streaming client's written with
    `direct` (none: every chunk wakes this task); this task wakes only for the rest."""
    stream = leg.stream
    loop = stream.loop
    usage_seen: list[Any] = [None, None]  # prompt and cached tokens, from the last usage chunk
    awaiting_first_token = ctx.record.ttft_s is None
    shape_run, shape_raw, shape_chunked, answer = (
        shaper.shape_run,
        shaper.shape_raw,
        shaper.shape_chunked,
        shaper.answer,
    )
    streaming = shaper.spec.stream
    relay_pending = direct is not None or not streaming  # a whole answer writes nothing before its end
    heard = [loop.time()]  # when the leg last sent something (its gaps are stalls, `on_gap`)

    def note_heard() -> None:
        now = loop.time()
        if on_gap is not None and now - heard[0] > STALL_LATE_S:  # rare
            on_gap(leg.backend, now - heard[0])
        heard[0] = now

    def relay_now(events: deque[bytes]) -> bool:
        """Plain token chunks taken as they arrive: written to the client (a streaming
        client's) or accumulated (a whole answer's); True when all were taken. Never raises:
        anything it does not take (a finish, usage, an error, the end of max_tokens, a full
        client buffer) is left to the pump, which reads it in full."""
        if streaming and (direct is None or not direct.ready()):
            return False
        event = shape_run(list(events))  # b"" for a whole answer
        if event is not None:
            if direct is not None and event:
                direct.write_now(event)
            events.clear()
        elif streaming:
            return False
        else:  # a chunk of the run is not plain: those before it, one by one
            while events and answer.room_for(1) and shape_raw(events[0]) == b"":
                events.popleft()
        note_heard()
        return not events

    def relay_chunked(data: bytes) -> tuple[int, int]:
        """`relay_now` on a read of the leg's chunked body, before it is read into events:
        its leading whole plain token chunks (bytes taken, chunks); (0, 0): none taken."""
        if streaming and (direct is None or not direct.ready()):
            return 0, 0
        shaped = shape_chunked(data)
        if shaped is None:
            return 0, 0
        event, taken, n = shaped
        if direct is not None and event:
            direct.write_now(event)
        note_heard()
        return taken, n

    def one_by_one(items: list[Any], events: list[bytes]) -> UpstreamError | None:
        """Items (payloads, or chunks the race parsed) shaped one at a time into `events`;
        the error that ends the leg, if one does (the items before it are in `events`)."""
        for item in items:
            try:
                if type(item) is bytes:
                    event = shape_raw(item)
                    if event is not None:
                        events.append(event)
                        continue
                    item = stream.parse(item)
                if item.get("usage"):
                    usage = message_usage(item)
                    usage_seen[:] = usage.prompt_tokens, usage.cached_tokens
                events.extend(map(format_event, shaper.shape(item)))
            except UpstreamError as e:
                return e
            except MalformedChunk as e:  # shape_raw too: tokens past max_tokens
                return UpstreamError(leg.backend, PROTOCOL, f"unreadable chunk: {e}")
        return None

    def shape_batch(batch: list[bytes], events: list[bytes]) -> UpstreamError | None:
        """Payloads received into `events`. Plain token chunks between the ones where
        something is decided (a leg's first chunk, its finish and usage) go as one run; the
        bytes only hint where the run is, `shape_run` checks every chunk of it."""
        n = len(batch)
        head, tail = 0, n
        if n > 1:  # one chunk (a paced stream's): tried as a run, no hint needed
            while head < n and not looks_plain(batch[head]):
                head += 1
            while tail - 1 > head and not looks_plain(batch[tail - 1]):  # batch[head] is plain
                tail -= 1
        bad = one_by_one(batch[:head], events) if head else None
        if bad is None and head < tail:
            run = batch if tail - head == n else batch[head:tail]
            event = shape_run(run)
            if event is not None:
                events.append(event)
            else:
                bad = one_by_one(run, events)
        if bad is None and tail < n:
            bad = one_by_one(batch[tail:], events)
        return bad

    try:
        # What the race read to decide (parsed), with what arrived after it: one write, not two.
        parsed: list[Any] = list(leg.buffered)
        batch = stream.ready_payloads() if parsed else await stream.next_payloads()
        while parsed or batch:
            # Everything already received goes to the client in one write.
            events: list[bytes] = []
            bad = one_by_one(parsed, events) if parsed else None
            parsed = []
            if bad is None:
                bad = shape_batch(batch, events)
            if awaiting_first_token and answer.first_token_seen:
                ctx.record_first_token(loop.time())
                awaiting_first_token = False
            if bad is None and not awaiting_first_token and stream.holds_bytes:
                # An answer read at once: past its first chunks, its plain token chunks
                # de-chunked and relayed by one split, the rest read as usual; same write.
                if made := stream.take_held(shape_chunked):
                    events.append(made)
                bad = shape_batch(stream.ready_payloads(), events)
            if events:
                # The leg's [DONE] came in this batch and the answer is complete: nothing
                # else is written before the caller's finish, which sends these events with
                # [DONE] and the end of the body (an answer read at once: one write, not three).
                last = bad is None and answer.finish_reason not in (None, CACHE_THRESHOLD) and stream.done
                await emit(events[0] if len(events) == 1 else b"".join(events), last)
            if bad is not None:
                raise bad
            if relay_pending and not awaiting_first_token:
                stream.relay_from_reads(relay_now, relay_chunked)
                relay_pending = False
            heard[0] = loop.time()
            batch = await stream.next_payloads()
            note_heard()
    except UpstreamError as e:
        stream.abort()
        return LegOutcome(e)
    except BaseException:
        stream.abort()
        raise
    stream.finish()
    return LegOutcome(None, usage_seen[0], usage_seen[1])
