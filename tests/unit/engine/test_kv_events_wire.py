"""The router's decoding of vLLM's KV-event batches, against batches vLLM's own classes
encode (vllm.distributed.kv_events), and the replay socket's frames.

vLLM is needed for the first tests: skipped without it, failed without it when
CACHEHIT_REQUIRE_REAL_ENGINE=1 (CI, where vLLM is installed).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import msgspec
import pytest

from router.engine.kv_events_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_batch,
    decode_seq,
    parse_replay_reply,
    replay_request,
)
from support.requirements import require_module


@pytest.fixture(scope="module")
def vllm_events() -> ModuleType:
    return require_module("vllm.distributed.kv_events")


def encode(batch: Any) -> bytes:
    return msgspec.msgpack.Encoder().encode(batch)


def test_a_batch_vllm_encodes_decodes_field_by_field(vllm_events: ModuleType) -> None:
    v = vllm_events
    stored = v.BlockStored(
        block_hashes=[b"\x01" * 32, b"\x02" * 32],
        parent_block_hash=b"\x00" * 32,
        token_ids=[5, 6, 7, 8],
        block_size=2,
        lora_id=3,
        medium=v.MEDIUM_CPU,
        lora_name="adapter",
        extra_keys=[("adapter",), ("adapter", "salt")],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        session_id="s",
    )
    removed = v.BlockRemoved(block_hashes=[b"\x01" * 32], medium=v.MEDIUM_GPU, group_idx=1)
    batch, skipped = decode_batch(
        encode(v.KVEventBatch(ts=12.5, events=[stored, removed, v.AllBlocksCleared()], data_parallel_rank=2))
    )
    assert skipped == 0
    assert (batch.ts, batch.data_parallel_rank) == (12.5, 2)
    s, r, c = batch.events
    assert isinstance(s, BlockStored)
    assert s.block_hashes == stored.block_hashes
    assert s.parent_block_hash == stored.parent_block_hash
    assert (s.token_ids, s.block_size, s.lora_id, s.medium, s.lora_name) == ([5, 6, 7, 8], 2, 3, "CPU", "adapter")
    assert s.extra_keys == [["adapter"], ["adapter", "salt"]]  # msgpack has no tuples
    assert s.group_idx == 0
    assert isinstance(r, BlockRemoved)
    assert (r.block_hashes, r.medium, r.group_idx) == ([b"\x01" * 32], "GPU", 1)
    assert isinstance(c, AllBlocksCleared)


def test_int_hashes_and_the_fields_vllm_leaves_out(vllm_events: ModuleType) -> None:
    v = vllm_events
    stored = v.BlockStored(
        block_hashes=[2**63 + 5], parent_block_hash=None, token_ids=[1], block_size=1,
        lora_id=None, medium=None, lora_name=None,
    )  # fmt: skip
    batch, _ = decode_batch(
        encode(v.KVEventBatch(ts=1.0, events=[stored, v.BlockRemoved(block_hashes=[7], medium=None)]))
    )
    s, r = batch.events
    assert isinstance(s, BlockStored)
    assert s.block_hashes == [2**63 + 5]
    assert (s.parent_block_hash, s.medium, s.lora_name, s.extra_keys, s.group_idx) == (None, None, None, None, None)
    assert isinstance(r, BlockRemoved)
    assert r.block_hashes == [7]
    assert batch.data_parallel_rank is None


def test_an_event_of_an_unknown_type_is_skipped_and_the_rest_kept() -> None:
    payload = msgspec.msgpack.encode(
        [
            3.0,
            [
                {"type": "BlockRetagged", "x": 1},
                {"type": "AllBlocksCleared"},
                {"type": "BlockRemoved", "block_hashes": [1]},
            ],
            0,
        ]
    )
    batch, skipped = decode_batch(payload)
    assert skipped == 1
    assert [type(e) for e in batch.events] == [AllBlocksCleared, BlockRemoved]


def test_unknown_fields_and_a_longer_batch_are_accepted() -> None:
    payload = msgspec.msgpack.encode(
        [3.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "new_field": [1, 2]}], 0, "later"]
    )
    batch, skipped = decode_batch(payload)
    assert skipped == 0
    assert isinstance(batch.events[0], BlockRemoved)
    assert batch.events[0].block_hashes == [1]


@pytest.mark.parametrize(
    "payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode(["x", []])]
)
def test_a_payload_that_is_no_batch_raises_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_replay_request_and_replies_speak_vllms_replay_socket() -> None:
    assert replay_request(258) == [b"", (258).to_bytes(8, "big")]
    assert parse_replay_reply([b"", b"topic", (9).to_bytes(8, "big"), b"payload"]) == (9, b"payload")
    assert parse_replay_reply([b"", b"", (-1).to_bytes(8, "big", signed=True), b""]) is None
    assert decode_seq((2**40).to_bytes(8, "big")) == 2**40
    with pytest.raises(DecodeError):
        parse_replay_reply([b"", b"t", b"short", b"p"])
    with pytest.raises(DecodeError):
        parse_replay_reply([b"t", b"p"])
