"""vLLM's KV-event stream on the wire: decoding its batches, encoding a replay request.

An engine started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", ...}'` publishes, on a ZeroMQ PUB socket, one multipart message per scheduler step
that had cache events: (topic, 8-byte big-endian sequence number, msgpack payload). The
payload is an `EventBatch` encoded as an array [ts, events, data_parallel_rank]; each event
is a map tagged by its class name in "type": BlockStored, BlockRemoved, AllBlocksCleared.
With a `replay_endpoint`, a ROUTER socket answers a request for "every batch from sequence
N" with the batches it still buffers, then an end marker (sequence -1, empty payload).

The structs below are decode-only and mirror vLLM's field order and tags. Every field the
router does not need to read is optional, unknown fields are ignored, and a batch holding
an event type this module does not know is decoded event by event with that event
skipped, so a newer vLLM that adds fields or events keeps working.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

# vLLM's media (vllm.distributed.kv_events.MEDIUM_*); None means the engine's GPU pool.
MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"
# The replay socket's end-of-replay marker: sequence -1 as a signed 8-byte integer.
END_OF_REPLAY = -1

# An engine's block hash: sha256 bytes by default, a 64-bit int with
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    """Blocks the engine now holds: `len(block_hashes)` blocks of `block_size` tokens,
    `token_ids` their tokens in order, chained after `parent_block_hash` (None: the first
    block of a prompt)."""

    kind: ClassVar[str] = "stored"
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # Per block: the LoRA name (when lora_name is set), multimodal identifiers, the cache
    # salt...: anything beyond the tokens that the engine's hash covered.
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    kind: ClassVar[str] = "removed"
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    kind: ClassVar[str] = "cleared"


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float  # the engine's wall clock (time.time()) when it published the batch
    events: list[Event]
    data_parallel_rank: int | None = None


class _LenientBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_lenient_decoder = msgspec.msgpack.Decoder(_LenientBatch)
_event_decoder = msgspec.msgpack.Decoder(Event)


class DecodeError(ValueError):
    """A payload that is not a KV-event batch."""


def decode_batch(payload: bytes) -> tuple[EventBatch, int]:
    """The batch in `payload` and how many of its events were of an unknown type (skipped).
    Raises DecodeError when the payload is not an event batch at all."""
    try:
        return _batch_decoder.decode(payload), 0
    except msgspec.DecodeError:
        pass  # maybe one event of a type this version does not know: one by one below
    try:
        lenient = _lenient_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise DecodeError(str(e)) from None
    events: list[Event] = []
    skipped = 0
    for raw in lenient.events:
        try:
            events.append(_event_decoder.decode(raw))
        except msgspec.DecodeError:
            skipped += 1
    return EventBatch(lenient.ts, events, lenient.data_parallel_rank), skipped


def decode_seq(frame: bytes) -> int:
    """A sequence-number frame (8 bytes, big-endian, signed: -1 ends a replay)."""
    if len(frame) != 8:
        raise DecodeError(f"expected an 8-byte sequence number, got {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to the replay ROUTER for every buffered batch from
    `start_seq` on (the empty frame is the ROUTER's envelope delimiter)."""
    return [b"", start_seq.to_bytes(8, "big")]


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """One reply of the replay socket, as a DEALER receives it ([b"", topic, seq,
    payload]): (seq, payload), or None for the end marker. Raises DecodeError otherwise."""
    if len(frames) != 4 or frames[0]:
        raise DecodeError(f"expected a replay reply of 4 frames, got {len(frames)}")
    seq = decode_seq(frames[2])
    return None if seq == END_OF_REPLAY else (seq, frames[3])
