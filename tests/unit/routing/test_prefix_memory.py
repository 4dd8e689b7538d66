"""The router's memory of where it sent prompt prefixes (router/routing/prefix_memory.py)."""

from __future__ import annotations

from router.routing.prefix_memory import PrefixMemory


def test_prefix_memory_is_bounded() -> None:
    mem = PrefixMemory(chunk_chars=4, max_entries=10)
    for i in range(50):
        mem.insert(mem.chunk_hashes(f"{i:04d}" * 3), f"b{i % 3}")
    assert len(mem._lru) <= 10
    assert sum(len(v) for v in mem._owners.values()) == len(mem._lru)


def test_placement_is_the_placed_share_and_when_each_holder_was_sent_it() -> None:
    m = PrefixMemory(chunk_chars=4)
    m.insert(m.chunk_hashes("abcdefgh"), "a", now=5.0)
    m.insert(m.chunk_hashes("abcdefgh"), "b", now=7.0)
    share, sent = m.placement("abcdefghijkl")  # two of its three chunks were sent
    assert share == 2 / 3
    assert sent == {"a": 5.0, "b": 7.0}
    assert m.placement("zzzz") == (0.0, {})
    assert m.placement("") == (0.0, {})
