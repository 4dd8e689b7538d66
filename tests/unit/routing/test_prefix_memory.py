"""The router's memory of where it sent prompt prefixes (router/routing/prefix_memory.py)."""

from __future__ import annotations

from router.routing.prefix_memory import ENTRY_BYTES, PrefixMemory


def _consistent(mem: PrefixMemory) -> None:
    assert sum(len(v) for v in mem._owners.values()) == len(mem)
    assert sum(len(lru) for lru in mem._lru.values()) == len(mem)
    assert all(mem._lru.values()), "a tenant without entries is kept"


def test_prefix_memory_is_bounded_in_bytes() -> None:
    mem = PrefixMemory(chunk_chars=4, max_bytes=10 * ENTRY_BYTES)
    for i in range(50):
        mem.insert(mem.chunk_hashes(f"{i:04d}" * 3), f"b{i % 3}")
    assert len(mem) <= 10
    assert mem.approx_bytes <= mem.max_bytes
    _consistent(mem)


def test_a_tenant_flooding_unique_prompts_evicts_only_its_own_entries() -> None:
    """Regression: 16 huge unique prompts of one tenant used to flush every tenant's
    prefixes (a global LRU)."""
    mem = PrefixMemory(chunk_chars=4, max_bytes=100 * ENTRY_BYTES)
    for tenant in ("a", "b"):
        mem.insert(mem.chunk_hashes(f"{tenant}sys" * 10), "d0", tenant=tenant)  # 10 entries each
    for i in range(16):
        mem.insert(mem.chunk_hashes(f"{i:03d}x" * 200), "d1", tenant="flood")
    assert len(mem) <= 100
    for tenant in ("a", "b"):  # under their share (a third each): untouched
        assert mem.entries_of(tenant) == 10
        assert mem.match(mem.chunk_hashes(f"{tenant}sys" * 10)) == (10, {"d0"})
    assert mem.entries_of("flood") == 80
    _consistent(mem)


def test_a_prompt_longer_than_the_share_keeps_its_beginning() -> None:
    mem = PrefixMemory(chunk_chars=4, max_bytes=20 * ENTRY_BYTES)
    text = "".join(f"{i:04d}" for i in range(100))
    mem.insert(mem.chunk_hashes(text), "d0", tenant="t")
    assert mem.match(mem.chunk_hashes(text)) == (20, {"d0"})


def test_past_the_budget_the_tenant_most_over_its_share_loses_its_oldest() -> None:
    mem = PrefixMemory(chunk_chars=4, max_bytes=30 * ENTRY_BYTES)
    mem.insert(mem.chunk_hashes("".join(f"a{i:03d}" for i in range(25))), "d0", tenant="a")
    mem.insert(mem.chunk_hashes("".join(f"b{i:03d}" for i in range(10))), "d0", tenant="b")
    # b is under its share (15): a, over it, makes room.
    assert (mem.entries_of("a"), mem.entries_of("b")) == (20, 10)
    # A's oldest went: its newest chunks stay, the first ones are gone.
    assert mem.match(mem.chunk_hashes("a000a001")) == (0, set())
    _consistent(mem)


def test_an_entry_belongs_to_the_tenant_that_sent_it_last() -> None:
    mem = PrefixMemory(chunk_chars=4, max_bytes=100 * ENTRY_BYTES)
    shared = mem.chunk_hashes("system prompt...")
    mem.insert(shared, "d0", tenant="a")
    mem.insert(shared, "d0", tenant="b")
    assert (mem.entries_of("a"), mem.entries_of("b")) == (0, 4)
    _consistent(mem)


def test_a_smaller_budget_applies_at_once() -> None:
    mem = PrefixMemory(chunk_chars=4, max_bytes=100 * ENTRY_BYTES)
    mem.insert(mem.chunk_hashes("x" * 400), "d0")
    mem.resize(10 * ENTRY_BYTES)
    assert len(mem) == 10
    _consistent(mem)


def test_the_recent_hashes_cache_is_bounded_by_the_budget() -> None:
    mem = PrefixMemory(chunk_chars=4, max_bytes=80 * ENTRY_BYTES)  # 10 hashes of recent prompts
    for i in range(5):
        mem.chunk_hashes(f"{i}" * 40)
    assert mem._recent_hashes <= 10
    assert sum(len(h) for h in mem._recent.values()) == mem._recent_hashes


def test_placement_is_the_placed_share_and_when_each_holder_was_sent_it() -> None:
    m = PrefixMemory(chunk_chars=4)
    m.insert(m.chunk_hashes("abcdefgh"), "a", now=5.0)
    m.insert(m.chunk_hashes("abcdefgh"), "b", now=7.0)
    share, sent = m.placement("abcdefghijkl")  # two of its three chunks were sent
    assert share == 2 / 3
    assert sent == {"a": 5.0, "b": 7.0}
    assert m.placement("zzzz") == (0.0, {})
    assert m.placement("") == (0.0, {})


def test_a_policy_remembers_each_prompt_under_its_tenant_within_the_configured_budget() -> None:
    from router.config.schema import RoutingConfig
    from router.routing.planning import RouteQuery
    from router.routing.policies.prefix_tree import PrefixTreeStrategy

    policy = PrefixTreeStrategy(RoutingConfig(prefix_memory_bytes=1000 * ENTRY_BYTES))
    assert policy.memory.max_entries == 1000
    policy.on_routed(RouteQuery("m", "x" * 640, tenant="acme"), "d0")
    assert policy.memory.entries_of("acme") == 10


def test_expected_hits_since_counts_only_engines_sent_the_prompt_at_or_after_their_time() -> None:
    m = PrefixMemory(chunk_chars=4)
    m.insert(m.chunk_hashes("abcdefgh"), "a", now=5.0)
    m.insert(m.chunk_hashes("abcdefgh"), "b", now=7.0)
    m.insert(m.chunk_hashes("abcdefgh"), "c", now=9.0)
    assert m.expected_hits("abcdefgh", 100.0) == {"a": 100.0, "b": 100.0, "c": 100.0}
    # a: sent before its oldest unanswered leg (answered since); b: at it; c: not named.
    assert m.expected_hits("abcdefgh", 100.0, sent_since={"a": 6.0, "b": 7.0}) == {"b": 100.0}
    assert m.expected_hits("abcdefgh", 100.0, sent_since={}) == {}
