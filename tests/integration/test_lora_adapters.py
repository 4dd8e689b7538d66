"""LoRA adapters loaded and unloaded through the router (router/server/lora_routes.py,
router/fleet/adapters.py): only the admin key may, only paths the router's configuration
names reach an engine, and the router's view changes at once: requests for an adapter go
only where it is held, from the load's answer on and no longer after the unload's."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from support.cluster import MODEL, Cluster, MakeCluster, long_prompt

ADMIN = {"Authorization": "Bearer sk-admin"}
PATHS = {"sql-lora": "/adapters/sql", "chat-lora": "/adapters/chat"}


async def _lora(c: Cluster, verb: str, body: dict[str, Any], key: dict[str, str] = ADMIN) -> tuple[int, Any]:
    async with await c.post(f"/v1/{verb}_lora_adapter", body, headers=key) as r:
        return r.status, await r.json()


async def _cluster(make_cluster: MakeCluster, **routing: Any) -> Cluster:
    return await make_cluster(
        decoders=3,
        server={"admin_api_key": "sk-admin"},
        # Slow health checks: what the router knows of the adapters comes from the calls.
        health={"check_interval_s": 60.0},
        routing={"strategy": "prefix_tree", "lora_adapters": PATHS, **routing},
    )


async def test_load_request_unload_through_the_router(make_cluster: MakeCluster) -> None:
    c = await _cluster(make_cluster)
    status, body = await _lora(c, "load", {"lora_name": "sql-lora", "backend": "d1"})
    assert (status, body) == (200, {"lora_name": "sql-lora", "backends": ["d1"]})
    # The engine was given the configured path.
    assert c.engines["d1"].config.lora_modules == {"sql-lora": "/adapters/sql"}
    assert c.registry.states["d1"].adapters == ("sql-lora",)
    # At once (no health check has run since): every request for it goes to d1.
    for i in range(4):
        status, out = await c.complete({"model": "sql-lora", "prompt": long_prompt(f"q{i}", 50), "max_tokens": 1})
        assert status == 200
        assert out["model"] == "sql-lora"
    served = await c.engine_metrics("vllm:request_success_total")
    assert (served["d0"], served["d1"], served["d2"]) == (0, 4, 0)

    status, body = await _lora(c, "unload", {"lora_name": "sql-lora"})
    assert (status, body) == (200, {"lora_name": "sql-lora", "backends": ["d1"]})
    assert c.engines["d1"].config.lora_modules == {}
    status, err = await c.complete({"model": "sql-lora", "prompt": "hello", "max_tokens": 1})
    assert status == 404
    assert err["error"]["param"] == "model"


async def test_only_the_admin_key_and_only_configured_paths(make_cluster: MakeCluster) -> None:
    c = await _cluster(make_cluster)
    status, _ = await _lora(c, "load", {"lora_name": "sql-lora"}, key={})
    assert status == 401
    # A client never names the path an engine reads.
    status, err = await _lora(c, "load", {"lora_name": "x", "lora_path": "/etc"})
    assert (status, err["error"]["param"]) == (400, "lora_path")
    status, err = await _lora(c, "load", {"lora_name": "not-configured"})
    assert (status, err["error"]["param"]) == (404, "lora_name")
    assert all(not e.config.lora_modules for e in c.engines.values())


async def test_without_an_admin_key_the_routes_do_not_exist(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1, routing={"lora_adapters": PATHS})
    status, _ = await _lora(c, "load", {"lora_name": "sql-lora"})
    assert status == 404
    assert not c.engines["d0"].config.lora_modules


async def test_a_load_without_a_backend_goes_where_the_cost_model_says(make_cluster: MakeCluster) -> None:
    c = await _cluster(make_cluster, max_adapters_per_engine=1)
    placed = []
    for name in ("sql-lora", "chat-lora"):
        status, body = await _lora(c, "load", {"lora_name": name})
        assert status == 200
        placed += body["backends"]
    # One adapter per engine at most: two engines.
    assert len(set(placed)) == 2
    status, _ = await _lora(c, "load", {"lora_name": "sql-lora", "backend": placed[1]})
    assert status == 409


async def test_autoload_loads_a_configured_adapter_a_request_names(make_cluster: MakeCluster) -> None:
    c = await _cluster(make_cluster, lora_autoload=True)
    status, _ = await c.complete({"model": "chat-lora", "prompt": long_prompt("a", 50), "max_tokens": 1})
    assert status == 200
    holders = [n for n, e in c.engines.items() if "chat-lora" in e.config.lora_modules]
    assert len(holders) == 1
    # An adapter the configuration does not name is not loaded: 404.
    status, _ = await c.complete({"model": "other-lora", "prompt": "hi", "max_tokens": 1})
    assert status == 404
    # Sent again, the prompt goes back to the engine holding the adapter and its cache.
    status, again = await c.complete({"model": "chat-lora", "prompt": long_prompt("a", 50), "max_tokens": 1})
    assert status == 200
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    status, _ = await c.complete({"model": MODEL, "prompt": "hello", "max_tokens": 1})
    assert status == 200


async def test_a_random_mix_of_four_adapters_over_four_engines_only_reaches_their_holders(
    make_cluster: MakeCluster,
) -> None:
    held = {"d0": ("sql", "chat"), "d1": ("chat", "code"), "d2": ("code", "legal"), "d3": ("legal", "sql")}
    for strategy in ("probe", "prefix_tree", "least_loaded", "round_robin"):
        c = await make_cluster(
            decoders=4,
            routing={"strategy": strategy},
            per_engine={n: {"lora_modules": {a: f"/adapters/{a}" for a in held[n]}} for n in held},
        )
        rng = random.Random(strategy)
        for i in range(24):
            adapter = rng.choice(("sql", "chat", "code", "legal"))
            # A few shared prefixes: the memory and the engines' caches pull toward engines
            # that saw the prompt, under this adapter or another one.
            prompt = long_prompt(f"group{rng.randrange(3)}", 120) + f" question {i}"
            status, out = await c.complete({"model": adapter, "prompt": prompt, "max_tokens": 2})
            assert status == 200, (strategy, adapter, out)
            assert out["model"] == adapter
        # An engine without the adapter answers 404: none was asked.
        assert c.router_metric_or_zero("cachehit_router_upstream_errors_total") == 0
        served = await c.engine_metrics("vllm:request_success_total")
        assert sum(served.values()) >= 24


async def test_a_model_list_read_before_a_load_does_not_undo_it(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = await _cluster(make_cluster)
    monitor = c.state.monitor
    assert monitor is not None
    read, release = asyncio.Event(), asyncio.Event()
    real = monitor._model_cards

    async def slow_list(url: str, key: str) -> list[dict[str, Any]] | None:
        cards = await real(url, key)  # read before the load: without the adapter
        read.set()
        await release.wait()
        return cards

    monkeypatch.setattr(monitor, "_model_cards", slow_list)
    check = asyncio.create_task(monitor.check_one("d1", with_health=True))
    await read.wait()
    status, _ = await _lora(c, "load", {"lora_name": "sql-lora", "backend": "d1"})
    assert status == 200
    release.set()
    await check
    assert c.registry.states["d1"].adapters == ("sql-lora",)
    status, _ = await c.complete({"model": "sql-lora", "prompt": "hello", "max_tokens": 1})
    assert status == 200
