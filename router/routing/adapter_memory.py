"""The router's prefix memory kept apart per LoRA adapter, as the engines keep their caches:
vLLM hashes a request's adapter into its KV blocks, so a prompt sent with adapter A is no
hit for the same prompt with adapter B or the base model. Each adapter gets a memory of its
own (router/routing/prefix_memory.py), the base model keeps the planner's; the adapters
least recently asked about are forgotten past `MAX_ADAPTERS`. Together the adapters' memories
hold at most the base memory's byte budget (`routing.prefix_memory_bytes`), a
`MAX_ADAPTERS`-th each, so adapters cannot multiply the router's memory."""

from __future__ import annotations

from collections import OrderedDict

from router.routing.prefix_memory import PrefixMemory

# Adapters whose memories are kept; each holds this share of the base memory's budget.
MAX_ADAPTERS = 16


class AdapterMemories:
    def __init__(self) -> None:
        self._by_adapter: OrderedDict[str, PrefixMemory] = OrderedDict()

    def get(self, base: PrefixMemory, adapter: str | None) -> PrefixMemory:
        """The memory of `adapter` (None: the base model's, `base`)."""
        if adapter is None:
            return base
        memory = self._by_adapter.get(adapter)
        if memory is None:
            memory = self._by_adapter[adapter] = PrefixMemory(base.chunk_chars, self.share(base))
            if len(self._by_adapter) > MAX_ADAPTERS:
                self._by_adapter.popitem(last=False)
        else:
            self._by_adapter.move_to_end(adapter)
            if memory.max_bytes != self.share(base):  # the base budget was reloaded
                memory.resize(self.share(base))
        return memory

    @staticmethod
    def share(base: PrefixMemory) -> int:
        return max(base.max_bytes // MAX_ADAPTERS, 1)

    def __len__(self) -> int:
        return len(self._by_adapter)
