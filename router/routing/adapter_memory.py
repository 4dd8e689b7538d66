"""The router's prefix memory kept apart per LoRA adapter, as the engines keep their caches:
vLLM hashes a request's adapter into its KV blocks, so a prompt sent with adapter A is no
hit for the same prompt with adapter B or the base model. Each adapter gets a memory of its
own (router/routing/prefix_memory.py), the base model keeps the planner's; the adapters
least recently asked about are forgotten past `MAX_ADAPTERS`."""

from __future__ import annotations

from collections import OrderedDict

from router.routing.prefix_memory import PrefixMemory

# Adapters whose memories are kept (each bounded by the memory's own bound).
MAX_ADAPTERS = 64


class AdapterMemories:
    def __init__(self) -> None:
        self._by_adapter: OrderedDict[str, PrefixMemory] = OrderedDict()

    def get(self, base: PrefixMemory, adapter: str | None) -> PrefixMemory:
        """The memory of `adapter` (None: the base model's, `base`)."""
        if adapter is None:
            return base
        memory = self._by_adapter.get(adapter)
        if memory is None:
            memory = self._by_adapter[adapter] = PrefixMemory()
            if len(self._by_adapter) > MAX_ADAPTERS:
                self._by_adapter.popitem(last=False)
        else:
            self._by_adapter.move_to_end(adapter)
        return memory

    def __len__(self) -> int:
        return len(self._by_adapter)
