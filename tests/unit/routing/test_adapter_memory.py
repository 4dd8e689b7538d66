"""The prefix memory kept per LoRA adapter (router/routing/adapter_memory.py), as vLLM keys
its blocks: a prompt the router sent under one adapter is no expected hit under another or
under the base model."""

from __future__ import annotations

from router.config.schema import RoutingConfig
from router.routing import adapter_memory
from router.routing.adapter_memory import AdapterMemories
from router.routing.planning import RouteQuery
from router.routing.policies import make_strategy
from router.routing.prefix_memory import PrefixMemory

TEXT = "the shared system prompt " * 40


def test_each_adapter_remembers_its_own_prompts() -> None:
    for policy in ("prefix_tree", "probe"):
        strategy = make_strategy(RoutingConfig(strategy=policy))
        sql = RouteQuery(model="sql", text=TEXT, prompt_tokens=200, adapter="sql")
        strategy.on_routed(sql, "d0")
        assert strategy.expected_hits(sql, 200) == {"d0": 200.0}
        # The same prompt with another adapter, or with the base model, is held nowhere.
        assert strategy.expected_hits(RouteQuery(model="chat", text=TEXT, adapter="chat"), 200) == {}
        assert strategy.expected_hits(RouteQuery(model="base", text=TEXT), 200) == {}
        strategy.on_routed(RouteQuery(model="base", text=TEXT), "d1")
        assert strategy.expected_hits(RouteQuery(model="base", text=TEXT), 200) == {"d1": 200.0}
        assert strategy.expected_hits(sql, 200) == {"d0": 200.0}


def test_the_base_model_keeps_the_planners_memory() -> None:
    base = PrefixMemory()
    memories = AdapterMemories()
    assert memories.get(base, None) is base
    assert memories.get(base, "sql") is memories.get(base, "sql") is not base
    assert len(memories) == 1


def test_the_adapters_least_recently_asked_about_are_forgotten() -> None:
    base = PrefixMemory()
    memories = AdapterMemories()
    first = memories.get(base, "a0")
    for i in range(1, adapter_memory.MAX_ADAPTERS + 1):
        memories.get(base, f"a{i}")
    assert len(memories) == adapter_memory.MAX_ADAPTERS
    assert memories.get(base, "a0") is not first  # forgotten, made anew


def test_the_adapters_memories_together_hold_at_most_the_base_budget() -> None:
    base = PrefixMemory(max_bytes=16 * 1024 * 1024)
    memories = AdapterMemories()
    held = [memories.get(base, f"a{i}") for i in range(adapter_memory.MAX_ADAPTERS)]
    assert sum(m.max_bytes for m in held) <= base.max_bytes
    # A reload that shrinks the base budget shrinks the adapters' shares with it.
    base.resize(4 * 1024 * 1024)
    assert memories.get(base, "a0").max_bytes == base.max_bytes // adapter_memory.MAX_ADAPTERS
