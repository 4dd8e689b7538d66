"""The CPU tier of the KV cache: vLLM 0.32's OffloadingConnector with its CPU backend.

What is kept from vLLM (vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py,
vllm/v1/kv_offload/cpu/manager.py, cpu/spec.py), with vLLM's defaults:
- stores are write-through, not on eviction: every step, each full block a request has just
  computed is copied to host memory (`_build_store_jobs`), so the CPU tier already holds a
  prefix when the GPU cache later evicts it;
- only prompt blocks are stored (`offload_prompt_only`, default true): the blocks of
  generated tokens live in the GPU cache only;
- a block already stored is not stored again; a full tier evicts its least recently used
  block (`eviction_policy` "lru"); a load marks the loaded blocks as recently used;
- lookup (`get_num_new_matched_tokens`) runs after the GPU prefix lookup and returns the run
  of consecutive stored blocks that follows the GPU hit, up to the request's last full block
  (unlike the GPU lookup, which stops before the block holding the last token: a fully
  stored block-aligned prompt scores a hit rate of 1.0); with the CPU cache manager it has
  no side effect;
- a hit is loaded asynchronously before the request runs (the request waits in
  WAITING_FOR_REMOTE_KVS, like a NIXL pull), costing `timing.cpu_load_token_s` per token
  instead of a recompute; the blocks then sit in the GPU cache as well.
- KV events (kv_events.py): an optional listener hears stores and evictions, which the
  connector publishes with medium "CPU".
What is left out: chunks of several blocks (`block_size` in the connector's extra config;
the default is one block), `store_threshold` filtering, pinned-memory accounting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol


class TierListener(Protocol):
    """Hears what the OffloadingConnector publishes as KV events."""

    def cpu_stored(self, request_id: str | None, block_indices: list[int]) -> None: ...

    def cpu_removed(self, block_hashes: list[int]) -> None: ...


class CpuTier:
    """LRU set of block hashes held in host memory; capacity in blocks."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(0, capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.stored_blocks = 0  # blocks copied to the tier (vllm:kv_offload_store_bytes)
        self.loaded_blocks = 0  # blocks copied back (vllm:kv_offload_load_bytes)
        self.evicted_blocks = 0
        self.listener: TierListener | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def store(self, block_hashes: Iterable[int], request_id: str | None = None) -> int:
        """Copy blocks in (already stored ones are skipped); returns how many were new.
        `block_hashes` are the request's from its first block on (the listener is told
        which of them were stored, by index)."""
        if not self.capacity:
            return 0
        blocks = self._blocks
        new = 0
        stored: dict[int, int] = {}  # hash -> index, of the blocks this call stores
        evicted: list[int] = []
        for i, h in enumerate(block_hashes):
            if h in blocks:
                continue
            if len(blocks) >= self.capacity:
                old = blocks.popitem(last=False)[0]
                self.evicted_blocks += 1
                # One stored and evicted within this call was never there for a listener.
                if stored.pop(old, None) is None:
                    evicted.append(old)
            blocks[h] = None
            stored[h] = i
            new += 1
        self.stored_blocks += new
        if self.listener is not None:
            # As the connector: a store's evictions are announced before the store.
            if evicted:
                self.listener.cpu_removed(evicted)
            if stored:
                self.listener.cpu_stored(request_id, list(stored.values()))
        return new

    def lookup(self, block_hashes: Sequence[int], start: int, stop: int) -> int:
        """Consecutive stored blocks from index `start` (before `stop`). Read-only."""
        n = 0
        blocks = self._blocks
        for h in block_hashes[start:stop]:
            if h not in blocks:
                break
            n += 1
        return n

    def load(self, block_hashes: Iterable[int]) -> None:
        """A load marks its blocks as most recently used."""
        for h in block_hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                self.loaded_blocks += 1

    def clear(self) -> None:
        self._blocks.clear()
