"""The paged KV cache: whole-block hits, the last-token cap, refcounts, LRU eviction."""

from __future__ import annotations

from engine_launcher.sim.kv_cache import KVCacheManager, hash_blocks

BS = 4


def hashes(tokens: list[int]) -> list[int]:
    out: list[int] = []
    hash_blocks(tokens, BS, out)
    return out


def run(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """Admit, compute and cache a request's tokens like the scheduler does."""
    h = hashes(tokens)
    hit = kv.find_cache_hit(h, len(tokens))
    assert kv.allocate(rid, len(tokens), hit)
    kv.cache_blocks(rid, h, len(tokens))


def test_only_full_blocks_are_hashed_and_chained() -> None:
    assert len(hashes(list(range(9)))) == 2
    # Same block content after a different prefix: different hash (chained).
    a = hashes([1, 2, 3, 4, 9, 9, 9, 9])
    b = hashes([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]


def test_hits_are_whole_blocks_and_leave_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = list(range(100, 116))  # 16 tokens = 4 full blocks
    run(kv, "a", prompt)
    kv.free("a")
    # Same prompt again: at most 15 tokens may hit -> 3 whole blocks.
    assert len(kv.find_cache_hit(hashes(prompt), len(prompt))) * BS == 12
    # A longer prompt with the same 16-token prefix hits all 4 blocks.
    longer = [*prompt, 7, 7, 7]
    assert len(kv.find_cache_hit(hashes(longer), len(longer))) * BS == 16
    # A prompt diverging inside block 2 hits block 1 only.
    other = prompt[:5] + [0] * 11
    assert len(kv.find_cache_hit(hashes(other), len(other))) == 1


def test_null_block_is_reserved_and_usage_counts_held_blocks() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    assert kv.num_free_blocks == 4
    assert kv.allocate("a", 8)
    assert kv.usage == 0.5
    assert all(b.block_id != 0 for b in kv.req_blocks["a"])
    assert not kv.allocate("b", 12)  # needs 3, 2 free: refused, nothing changed
    assert kv.num_free_blocks == 2
    assert "b" not in kv.req_blocks


def test_referenced_blocks_are_never_evicted() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    prompt = list(range(8))
    run(kv, "a", prompt)  # holds 2 cached blocks
    assert kv.allocate("b", 8)  # takes the other 2
    assert not kv.allocate("c", 4)
    assert len(kv.find_cache_hit(hashes([*prompt, 1]), 9)) == 2


def test_lru_eviction_takes_the_least_recently_freed_block_first() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable blocks
    old = [1] * 4 + [2] * 4
    new = [3] * 4 + [4] * 4
    run(kv, "old", old)
    kv.free("old")
    run(kv, "new", new)
    kv.free("new")
    # Every block is free and cached; one more block must evict the oldest free one.
    # Requests free tail-first, so "old"'s second block went to the queue first.
    assert kv.allocate("x", 4)
    assert len(kv.find_cache_hit(hashes([*old, 0]), 9)) == 1
    assert len(kv.find_cache_hit(hashes([*new, 0]), 9)) == 2
    kv.free("x")


def test_a_hit_takes_a_free_cached_block_back_out_of_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)  # 2 usable blocks
    p = list(range(8))
    run(kv, "a", p)
    kv.free("a")
    h = hashes([*p, 9])
    hit = kv.find_cache_hit(h, 9)
    assert len(hit) == 2
    assert kv.allocate("b", 8, hit)
    assert kv.num_free_blocks == 0
    assert all(b.ref_cnt == 1 for b in hit)
    assert kv.allocate("c", 0)
    assert kv.num_free_blocks == 0
    kv.free("b")
    assert kv.num_free_blocks == 2


def test_shared_blocks_stay_until_the_last_reference_goes() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    p = list(range(8))
    run(kv, "a", [*p, 50])
    run(kv, "b", [*p, 60])  # shares the 2 prompt blocks
    shared = kv.req_blocks["a"][:2]
    assert all(b.ref_cnt == 2 for b in shared)
    kv.free("a")
    assert all(b.ref_cnt == 1 for b in shared)
    kv.free("b")
    assert kv.usage == 0.0


def test_reset_prefix_cache_refuses_while_blocks_are_held() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run(kv, "a", list(range(8)))
    assert not kv.reset_prefix_cache()
    kv.free("a")
    assert kv.reset_prefix_cache()
    assert kv.find_cache_hit(hashes(list(range(9))), 9) == []


def test_prefix_caching_off_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    run(kv, "a", list(range(8)))
    kv.free("a")
    assert kv.find_cache_hit(hashes(list(range(9))), 9) == []
