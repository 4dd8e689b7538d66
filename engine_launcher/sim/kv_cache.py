"""A paged KV cache with prefix caching, modelled on vLLM V1's block pool.

What is kept from vLLM (vllm/v1/core/block_pool.py, kv_cache_manager.py, kv_cache_utils.py):
- fixed-size blocks; block 0 is the reserved "null block", so capacity is num_blocks - 1;
- a block's hash chains the parent block's hash with the block's token ids, so equal hashes
  mean equal prefixes; only *full* blocks are hashed and cached;
- reference counts: a block used by a running request is never evicted; a block whose
  count drops to 0 goes to the tail of the free queue but keeps its hash (still a hit);
- allocation takes blocks from the head of the free queue (least recently freed first)
  and evicts the hash of a cached block it reuses: LRU eviction;
- a request's blocks are freed tail first, so the end of a sequence is evicted before its
  shared prefix;
- a cache hit is a run of whole blocks from the start and stops before the last token
  (max hit = num_tokens - 1, rounded down to blocks): vLLM must recompute the last token
  to get logits.
- a LoRA adapter's blocks hash apart from the base model's (vLLM puts the adapter in the
  block hash's extra keys), so they never serve each other's hits;
- KV events (kv_events.py): an optional listener hears each block cached, each cached block
  evicted and each reset, where vLLM's block pool queues BlockStored, BlockRemoved and
  AllBlocksCleared.
What is left out: hybrid/sliding-window groups, multimodal extra keys, salts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

# Seed of the hash chain (vLLM derives its NONE_HASH from a fixed seed too): a constant, so
# every simulator process hashes a prefix alike and published hashes compare across engines.
_ROOT_HASH = 0x5EED


class CacheListener(Protocol):
    """Hears the cache changes that vLLM publishes as KV events."""

    def gpu_stored(self, request_id: str, block_indices: list[int]) -> None: ...

    def gpu_removed(self, block_hash: int) -> None: ...

    def gpu_cleared(self) -> None: ...


def _root_hash(lora_name: str | None) -> int:
    if lora_name is None:
        return _ROOT_HASH
    # A digest, not hash(str): str hashes are salted per process.
    digest = int.from_bytes(hashlib.blake2b(lora_name.encode(), digest_size=8).digest(), "big")
    return hash((_ROOT_HASH, digest))


class Block:
    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append to the tail and
    removal from the middle (a cache hit takes a free cached block back)."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> Block:
        b = self._head.next
        if b is self._tail or b is None:
            raise IndexError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: Block) -> None:
        assert b.prev is not None
        assert b.next is not None
        b.prev.next = b.next
        b.next.prev = b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def append(self, b: Block) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = b
        b.prev = last
        b.next = self._tail
        self._tail.prev = b
        self.num_free += 1

    def __iter__(self) -> Iterator[Block]:
        b = self._head.next
        while b is not None and b is not self._tail:
            yield b
            b = b.next


def hash_blocks(token_ids: Sequence[int], block_size: int, hashes: list[int], lora_name: str | None = None) -> None:
    """Extend `hashes` with the chained hashes of every further full block of `token_ids`."""
    start = len(hashes)
    parent = hashes[-1] if hashes else _root_hash(lora_name)
    for i in range(start, len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Block 0 is vLLM's null block: never allocated, not counted in usage.
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[int, Block] = {}
        # Per request: its blocks in order, and how many of them are hashed and cached.
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_num_cached: dict[str, int] = {}
        self.listener: CacheListener | None = None

    # --- queries -----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.free_queue.num_free / (self.num_blocks - 1)

    def find_cache_hit(self, block_hashes: Sequence[int], num_tokens: int) -> list[Block]:
        """Longest run of cached blocks from the start, leaving at least the last token to
        compute. Read-only: nothing is touched, so it doubles as the arrival-time lookup."""
        if not self.enable_caching:
            return []
        max_blocks = (num_tokens - 1) // self.block_size
        hit: list[Block] = []
        cached = self.cached
        for h in block_hashes[:max_blocks]:
            b = cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    # --- allocation --------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, hit_blocks: Sequence[Block] = ()) -> bool:
        """Make the request own enough blocks for `num_tokens` tokens, first taking
        `hit_blocks` (a fresh cache hit). False, with nothing changed, when blocks run out."""
        blocks = self.req_blocks.get(request_id)
        have = len(blocks) if blocks is not None else 0
        need = -(-num_tokens // self.block_size) - have - len(hit_blocks)
        # Cache-hit blocks that are free would leave the free queue too.
        hit_free = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if need + hit_free > self.free_queue.num_free:
            return False
        if blocks is None:
            blocks = self.req_blocks[request_id] = []
            self.req_num_cached[request_id] = 0
        for b in hit_blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            blocks.append(b)
        if hit_blocks:
            self.req_num_cached[request_id] = len(blocks)
        for _ in range(max(need, 0)):
            b = self.free_queue.popleft()
            if b.block_hash is not None:  # evict: the block is reused for other tokens
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                    if self.listener is not None:
                        self.listener.gpu_removed(b.block_hash)
                b.block_hash = None
            b.ref_cnt = 1
            blocks.append(b)
        return True

    def cache_blocks(self, request_id: str, block_hashes: Sequence[int], num_computed: int) -> None:
        """Register the request's full, computed blocks under their hashes."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        start = self.req_num_cached[request_id]
        end = min(num_computed // self.block_size, len(block_hashes), len(blocks))
        stored: list[int] = []
        for i in range(start, end):
            b = blocks[i]
            h = block_hashes[i]
            if b.block_hash is None and h not in self.cached:
                b.block_hash = h
                self.cached[h] = b
                stored.append(i)
            # A duplicate of an already cached block stays unhashed (as in vLLM, the first
            # one keeps serving hits); it is not announced, so no removal is owed for it.
        if stored and self.listener is not None:
            self.listener.gpu_stored(request_id, stored)
        if end > start:
            self.req_num_cached[request_id] = end

    def free(self, request_id: str) -> None:
        """Drop the request's references, tail block first (evicted first)."""
        blocks = self.req_blocks.pop(request_id, None)
        self.req_num_cached.pop(request_id, None)
        if not blocks:
            return
        self.release(reversed(blocks))

    def take(self, request_id: str) -> list[Block]:
        """Detach a finished request's blocks without freeing them (a producer's lease)."""
        self.req_num_cached.pop(request_id, None)
        return self.req_blocks.pop(request_id, [])

    def release(self, blocks: Iterable[Block]) -> None:
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; like vLLM, refuse while any block is in use."""
        if self.free_queue.num_free != self.num_blocks - 1:
            return False
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()
        if self.listener is not None:
            self.listener.gpu_cleared()
        return True
