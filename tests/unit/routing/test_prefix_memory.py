"""The router's memory of where it sent prompt prefixes (router/routing/prefix_memory.py)."""

from __future__ import annotations

from router.routing.prefix_memory import PrefixMemory


def test_prefix_memory_is_bounded() -> None:
    mem = PrefixMemory(chunk_chars=4, max_entries=10)
    for i in range(50):
        mem.insert(mem.chunk_hashes(f"{i:04d}" * 3), f"b{i % 3}")
    assert len(mem._lru) <= 10
    assert sum(len(v) for v in mem._owners.values()) == len(mem._lru)
