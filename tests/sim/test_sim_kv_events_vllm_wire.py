"""The simulator's KV event batches and replay frames compared byte for byte with vLLM's
own encoder and publisher (skipped without vllm)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine_launcher.sim import kv_events as sim_kv_events
from engine_launcher.sim.kv_events import KVEventBatch, encode_batch, wire_hash
from support.requirements import require_module
from support.sim_kv_events import END_SEQ, TOPIC, local, sync_replay


def need_vllm() -> None:
    require_module("vllm")


def test_batches_encode_byte_for_byte_as_vllms() -> None:
    need_vllm()
    from vllm.distributed import kv_events as v

    h = [wire_hash(x) for x in (-5, 1 << 40, -(1 << 62))]

    def events(m: Any) -> list[Any]:
        return [
            m.BlockStored(
                block_hashes=h[:2],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, None],
                group_idx=0,
            ),
            m.BlockStored(
                block_hashes=[h[2]],
                parent_block_hash=h[1],
                token_ids=list(range(16)),
                block_size=16,
                lora_id=3,
                medium="GPU",
                lora_name="chat-fr",
                extra_keys=[("chat-fr",)],
                group_idx=0,
            ),
            m.BlockStored(
                block_hashes=[h[0]],
                parent_block_hash=h[2],
                token_ids=list(range(16)),
                block_size=16,
                lora_id=None,
                medium="CPU",
                lora_name=None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            m.BlockRemoved(block_hashes=[h[0]], medium="GPU", group_idx=0),
            m.BlockRemoved(block_hashes=h, medium="CPU", group_idx=0),
            m.AllBlocksCleared(),
        ]

    ours = encode_batch(KVEventBatch(ts=1712345678.25, events=events(sim_kv_events), data_parallel_rank=0))
    theirs = msgspec.msgpack.encode(v.KVEventBatch(ts=1712345678.25, events=events(v), data_parallel_rank=0))
    assert ours == theirs
    # And vLLM's own decoder reads ours.
    decoded = msgspec.msgpack.Decoder(v.KVEventBatch).decode(ours)
    assert isinstance(decoded.events[1], v.BlockStored)
    assert decoded.events[1].lora_name == "chat-fr"
    assert v.ZmqEventPublisher.END_SEQ == END_SEQ


def test_replay_frames_match_vllms_own_publisher() -> None:
    need_vllm()
    from vllm.distributed import kv_events as v

    from engine_launcher.sim.kv_event_publisher import ZmqEventPublisher
    from support.ports import free_port

    def batch(m: Any) -> Any:
        stored = m.BlockStored(
            block_hashes=[7, 8],
            parent_block_hash=None,
            token_ids=list(range(32)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None, None],
            group_idx=0,
        )
        return m.KVEventBatch(ts=1.5, events=[stored, m.AllBlocksCleared()], data_parallel_rank=0)

    theirs = v.ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint=f"tcp://*:{free_port()}", topic=TOPIC)
    ours = ZmqEventPublisher("tcp://*:0", "tcp://*:0", 10, 100, 100, TOPIC)
    ctx = zmq.Context()
    try:
        theirs.publish(batch(v))
        theirs.publish(batch(v))
        ours.publish(encode_batch(batch(sim_kv_events)))
        ours.publish(encode_batch(batch(sim_kv_events)))
        answers = []
        for endpoint in (theirs.get_publisher_config().replay_endpoint, ours.replay_endpoint):
            deadline = time.monotonic() + 10
            while len(frames := sync_replay(ctx, local(endpoint), 1)) < 2:  # published by its thread
                assert time.monotonic() < deadline, "the batches were not published"
            answers.append(frames)
        assert answers[0] == answers[1]
        assert answers[1] == [
            [b"", TOPIC.encode(), (1).to_bytes(8, "big"), encode_batch(batch(sim_kv_events))],
            [b"", b"", END_SEQ, b""],
        ]
    finally:
        theirs.shutdown()
        ours.close()
        ctx.destroy(linger=0)
