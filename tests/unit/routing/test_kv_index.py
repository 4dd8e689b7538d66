"""The KV block index (router/routing/kv_index.py) over event batches built by hand: the
chained keys, tiers, removals, clears, orphans, ranks, the cap."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.engine.kv_events_wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event, EventBatch
from router.routing.kv_index import KvHit, KvIndex

BS = 4
PROMPT = list(range(100, 124))  # 6 blocks of 4


def stored(
    hashes: Sequence[BlockHash],
    tokens: Sequence[int],
    parent: BlockHash | None = None,
    medium: str = "GPU",
    lora: str | None = None,
    extra: list[Any] | None = None,
    size: int = BS,
    group: int | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens), block_size=size,
        medium=medium, lora_name=lora, extra_keys=extra, group_idx=group,
    )  # fmt: skip


def batch(*events: Event, rank: int | None = None) -> EventBatch:
    return EventBatch(ts=1.0, events=list(events), data_parallel_rank=rank)


def store_prompt(
    idx: KvIndex,
    engine: str,
    n_blocks: int,
    prefix: str = "h",
    medium: str = "GPU",
    in_events: int = 1,
    rank: int | None = None,
) -> list[BlockHash]:
    """The prompt's first n_blocks stored by `engine`, in `in_events` events chained by parent."""
    hashes: list[BlockHash] = [f"{engine}{prefix}{i}".encode() for i in range(n_blocks)]
    per = -(-n_blocks // in_events)
    for start in range(0, n_blocks, per):
        part = hashes[start : start + per]
        parent = hashes[start - 1] if start else None
        idx.apply(engine, batch(stored(part, PROMPT[start * BS : (start + len(part)) * BS], parent, medium), rank=rank))
    return hashes


def test_chained_stores_match_the_prompts_keys() -> None:
    idx = KvIndex()
    store_prompt(idx, "a", 4, in_events=3)
    store_prompt(idx, "b", 2)
    assert idx.match(PROMPT) == {"a": KvHit(16, 0), "b": KvHit(8, 0)}
    keys = idx.prompt_keys(PROMPT, BS)
    assert len(keys.keys) == 6
    assert idx.hits(keys) == idx.match(PROMPT)
    assert idx.block_size("a") == BS
    # Another prompt sharing only the first block.
    other = [*PROMPT[:4], *([9] * 20)]
    assert idx.match(other) == {"a": KvHit(4, 0), "b": KvHit(4, 0)}


def test_keys_follow_the_whole_prefix_not_the_block_alone() -> None:
    idx = KvIndex()
    store_prompt(idx, "a", 3)
    shifted = [1, 2, 3, 4, *PROMPT[4:]]
    assert idx.match(shifted) == {"a": KvHit(0, 0)}


def test_cpu_tier_counts_after_the_gpu_run() -> None:
    idx = KvIndex()
    hashes = store_prompt(idx, "a", 5)
    idx.apply("a", batch(stored(hashes, PROMPT[:20], medium="CPU")))  # offloaded copies
    idx.apply("a", batch(BlockRemoved(block_hashes=hashes[2:], medium="GPU")))
    assert idx.match(PROMPT) == {"a": KvHit(8, 12)}
    st = idx.stats("a")
    assert (st.blocks, st.gpu_blocks, st.cpu_blocks) == (5, 2, 5)
    idx.apply("a", batch(BlockRemoved(block_hashes=hashes[3:4], medium="CPU")))
    assert idx.match(PROMPT) == {"a": KvHit(8, 4)}
    assert idx.stats("a").blocks == 4  # gone from both tiers: gone


def test_a_token_less_placeholder_adds_a_tier_to_a_known_hash() -> None:
    idx = KvIndex()
    hashes = store_prompt(idx, "a", 2)
    idx.apply("a", batch(stored(hashes[:1], [], size=0, medium="CPU"), stored([b"unknown"], [], size=0, medium="CPU")))
    assert idx.stats("a").cpu_blocks == 1
    assert idx.stats("a").orphans == 1


def test_removed_and_cleared() -> None:
    idx = KvIndex()
    hashes = store_prompt(idx, "a", 4)
    idx.apply("a", batch(BlockRemoved(block_hashes=[hashes[1]], medium=None)))
    assert idx.match(PROMPT) == {"a": KvHit(4, 0)}
    idx.apply("a", batch(AllBlocksCleared()))
    assert idx.match(PROMPT) == {"a": KvHit(0, 0)}
    assert idx.stats("a").blocks == 0


def test_a_block_whose_parent_is_unknown_is_an_orphan() -> None:
    idx = KvIndex()
    idx.apply("a", batch(stored([b"x1", b"x2"], PROMPT[4:12], parent=b"never-seen")))
    st = idx.stats("a")
    assert (st.blocks, st.orphans) == (0, 2)
    # Its children cannot chain either.
    idx.apply("a", batch(stored([b"x3"], PROMPT[12:16], parent=b"x2")))
    assert idx.stats("a").orphans == 3


def test_restore_of_a_reused_prefix_is_idempotent() -> None:
    idx = KvIndex()
    store_prompt(idx, "a", 3)
    store_prompt(idx, "a", 3)  # vLLM re-announces blocks a request reused
    assert idx.stats("a").blocks == 3
    assert idx.match(PROMPT) == {"a": KvHit(12, 0)}


def test_lora_and_extra_keys_separate_the_chains() -> None:
    idx = KvIndex()
    idx.apply("a", batch(stored([b"l0", b"l1"], PROMPT[:8], lora="ad", extra=[["ad"], ["ad"]])))
    idx.apply("b", batch(stored([b"s0"], PROMPT[:4], extra=[["salt"]])))
    assert idx.match(PROMPT) == {"a": KvHit(0, 0), "b": KvHit(0, 0)}
    assert idx.match(PROMPT, lora="ad") == {"a": KvHit(8, 0), "b": KvHit(0, 0)}


def test_other_kv_cache_groups_are_skipped() -> None:
    idx = KvIndex()
    idx.apply("a", batch(stored([b"g1"], PROMPT[:4], group=1)))
    assert idx.stats("a").blocks == 0


def test_ranks_are_kept_apart_and_folded_to_the_best() -> None:
    idx = KvIndex()
    store_prompt(idx, "a", 2, rank=0)
    store_prompt(idx, "a", 5, prefix="r1-", rank=1)
    assert idx.match(PROMPT) == {"a": KvHit(20, 0)}
    assert idx.stats("a").blocks == 7
    idx.clear("a")
    assert idx.stats("a").blocks == 0
    idx.forget("a")
    assert idx.match(PROMPT) == {}


def test_engines_of_another_block_size_are_matched_with_their_own() -> None:
    idx = KvIndex()
    store_prompt(idx, "a", 3)
    idx.apply("b", batch(stored([b"b0"], PROMPT[:8], size=8)))
    assert idx.block_sizes() == {4, 8}
    assert idx.match(PROMPT) == {"a": KvHit(12, 0), "b": KvHit(8, 0)}
    assert idx.hits(idx.prompt_keys(PROMPT, 8)) == {"b": KvHit(8, 0)}


def test_the_cap_evicts_the_oldest_and_marks_the_view_incomplete() -> None:
    idx = KvIndex(max_blocks_per_engine=4)
    store_prompt(idx, "a", 6, in_events=6)
    st = idx.stats("a")
    assert st.blocks <= 4
    assert st.evicted >= 2
    assert not st.complete
    assert idx.match(PROMPT) == {"a": KvHit(0, 0)}  # the chain's head went first
    idx.clear("a")
    assert idx.stats("a").complete


def test_prompt_keys_of_what_no_engine_can_hold() -> None:
    assert KvIndex.prompt_keys([1, 2, 3], BS).keys == ()
    assert KvIndex.prompt_keys([-1] * 8, BS).keys == ()
    assert KvIndex.prompt_keys(PROMPT, 0).keys == ()
    assert KvIndex.prompt_keys(tuple(PROMPT), BS) == KvIndex.prompt_keys(PROMPT, BS)
    assert KvIndex().match(PROMPT) == {}


def test_match_request_takes_the_model_for_an_adapter_only_once_engines_stored_under_it() -> None:
    idx = KvIndex()
    assert idx.match_request(PROMPT, "m") is None  # no index yet
    store_prompt(idx, "a", 2)
    assert idx.match_request(None, "m") is None  # a text prompt
    assert idx.match_request(PROMPT, "m") == {"a": KvHit(8, 0)}
    idx.apply("a", batch(stored([b"l0"], PROMPT[:4], lora="ad")))
    assert idx.match_request(PROMPT, "ad") == {"a": KvHit(4, 0)}


def test_the_last_removal_is_when_a_block_left_the_engines_view() -> None:
    clock = [10.0]
    idx = KvIndex(clock=lambda: clock[0])
    hashes = store_prompt(idx, "a", 3)
    assert idx.last_removal("a") == 0.0  # stores only
    clock[0] = 20.0
    idx.apply("a", batch(BlockRemoved(block_hashes=hashes[2:], medium="GPU")))
    assert idx.last_removal("a") == 20.0
    clock[0] = 30.0
    idx.apply("a", batch(AllBlocksCleared()))
    assert idx.last_removal("a") == 30.0
    clock[0] = 40.0
    idx.clear("a")  # a restart, or a stream the router cannot trust
    assert idx.last_removal("a") == 40.0
    assert idx.last_removal("unknown") == 0.0
    store_prompt(idx, "b", 1)  # stores only: known, never lost a block
    assert idx.last_removals() == {"a": 40.0, "b": 0.0}
