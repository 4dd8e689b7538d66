"""Reloading the configuration while serving (what SIGHUP runs): backends and routing keys
change without dropping a request; keys bound at start are named in a warning; a file that
does not validate changes nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import pytest

from engine_launcher.sim import SimEngineConfig, start_sim_engine
from router.config.parse import parse_config
from router.config.schema import Config
from router.routing import policies
from router.routing.policies.prefix_tree import PrefixTreeStrategy
from router.routing.policies.probe import ProbeStrategy
from router.server.reload import changed_keys, reload, split_changes
from router.server.settings import parse_checked
from support.cluster import MODEL, Cluster, MakeCluster, dispatcher_of, long_prompt, registry_of
from support.polling import eventually


def raw_of(c: Cluster, backends: list[dict[str, Any]], **tables: Any) -> dict[str, Any]:
    """The running cluster's configuration as a file would say it, with other backends."""
    cfg = c.state.config
    return {
        "server": {"port": 0, "admin_api_key": cfg.server.admin_api_key, **tables.pop("server", {})},
        "routing": {"min_pd_prompt_tokens": 64, **tables.pop("routing", {})},
        "timeouts": dataclasses.asdict(cfg.timeouts),
        "health": dataclasses.asdict(cfg.health),
        "backends": backends,
        **tables,
    }


def configured(c: Cluster) -> list[dict[str, Any]]:
    return [{"name": n, "url": e.url, "role": "decode"} for n, e in c.engines.items()]


def test_live_and_fixed_keys_are_told_apart() -> None:
    base = {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    old = parse_config(base)
    new = parse_config(
        {
            **base,
            "server": {"port": 9, "api_keys": ["k"]},
            "routing": {"cache_hit_threshold": 0.7},
            "timeouts": {"idle_s": 3},
        }
    )
    assert changed_keys(old, new) == [
        "server.port",
        "server.api_keys",
        "routing.cache_hit_threshold",
        "timeouts.idle_s",
    ]
    assert split_changes(old, new) == (
        ["server.api_keys", "routing.cache_hit_threshold"],
        ["server.port", "timeouts.idle_s"],
    )


async def test_reload_swaps_backends_without_dropping_a_stream(
    make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    c = await make_cluster(decoders=2, sim={"speed": 2.0})
    extra = await start_sim_engine(SimEngineConfig(model=MODEL, speed=50.0, role="consumer"), port=0)
    try:
        # d1 keeps streaming while a reload removes it from the file.
        state = c.state
        registry_of(state).set_draining("d0", True)
        stream = asyncio.create_task(c.stream({"model": MODEL, "prompt": long_prompt("hup", 40), "max_tokens": 40}))
        await eventually(lambda: c.engines["d1"].engine.num_running > 0, what="the stream on d1")
        registry_of(state).set_draining("d0", False)

        backends = [b for b in configured(c) if b["name"] == "d0"] + [
            {"name": "e0", "url": extra.url, "role": "decode", "models": [MODEL], "prefill_tokens_per_s": 3000.0}
        ]
        raw = raw_of(
            c,
            backends,
            routing={"cache_hit_threshold": 0.8, "prior_prefill_tokens_per_s": 5000.0},
            server={"port": 1234},
        )
        with caplog.at_level(logging.WARNING, logger="cachehit_router.reload"):
            fixed = await reload(state, lambda: parse_checked(raw))
        assert fixed == ["server.port"]
        assert "restart it to apply them: server.port" in caplog.text
        assert state.config.server.port == 0  # not applied
        assert policies.settings(state.config.routing).cache_hit_threshold == 0.8
        strategy = dispatcher_of(state).strategy
        assert isinstance(strategy, ProbeStrategy)
        assert strategy.config.cache_hit_threshold == 0.8
        assert registry_of(state).states["e0"].healthy  # checked when added
        # The cost model starts from the new priors: the fleet's, and the added engine's own.
        assert registry_of(state).learner.prior.per_token_s == 1.0 / 5000.0
        assert registry_of(state).learner.speed("e0").per_token_s == 1.0 / 3000.0
        assert registry_of(state).states["d1"].draining
        assert state.fleet is not None
        assert state.fleet.removing("d1")

        status, events = await stream
        assert status == 200
        assert events[-1] == "[DONE]"
        assert not any("error" in e for e in events[:-1])
        assert sum(1 for e in events[:-1] if e.get("choices") and e["choices"][0].get("text")) == 40
        await eventually(lambda: "d1" not in registry_of(state).states, what="d1's removal")
        assert set(registry_of(state).states) == {"d0", "e0"}
        for i in range(4):
            status, out = await c.complete({"model": MODEL, "prompt": f"after the reload {i}", "max_tokens": 2})
            assert status == 200, out
    finally:
        await extra.close()


async def test_reload_changes_strategy_and_keeps_the_prefix_memory(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, routing={"strategy": "prefix_tree"})
    state = c.state
    before = dispatcher_of(state).strategy
    assert isinstance(before, PrefixTreeStrategy)
    assert (await c.complete({"model": MODEL, "prompt": long_prompt("mem", 100), "max_tokens": 2}))[0] == 200
    # Same strategy, another key: the memory of where prompts went carries over.
    await reload(
        state, lambda: parse_config(raw_of(c, configured(c), routing={"strategy": "prefix_tree", "max_retries": 1}))
    )
    after = dispatcher_of(state).strategy
    assert after is not before
    assert isinstance(after, PrefixTreeStrategy)
    assert after.memory is before.memory
    # Another strategy: requests from now on are planned by it.
    await reload(state, lambda: parse_config(raw_of(c, configured(c), routing={"strategy": "probe"})))
    assert dispatcher_of(state).strategy.name == "probe"
    hits = c.routes()["probe_hit"]
    assert (await c.complete({"model": MODEL, "prompt": long_prompt("mem", 100), "max_tokens": 2}))[0] == 200
    assert c.routes()["probe_hit"] == hits + 1  # a probe race found the engine holding it


async def test_reload_rotates_client_keys(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1, server={"api_keys": ["sk-old"]})
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    ok = await c.post("/v1/completions", body, headers={"Authorization": "Bearer sk-old"})
    assert ok.status == 200
    await reload(c.state, lambda: parse_config(raw_of(c, configured(c), server={"api_keys": ["sk-new"]})))
    old = await c.post("/v1/completions", body, headers={"Authorization": "Bearer sk-old"})
    new = await c.post("/v1/completions", body, headers={"Authorization": "Bearer sk-new"})
    assert (old.status, new.status) == (401, 200)


async def test_a_bad_file_changes_nothing(make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture) -> None:
    c = await make_cluster(decoders=2)
    raw = raw_of(c, configured(c)[:1], routing={"cache_hit_threshold": 7})
    before = c.state.config
    with caplog.at_level(logging.ERROR, logger="cachehit_router.reload"):
        assert await reload(c.state, lambda: parse_checked(raw)) == []
    assert "routing.cache_hit_threshold: expected a number in [0, 1]" in caplog.text
    assert c.state.config is before
    assert set(c.registry.states) == {"d0", "d1"}


async def test_a_reload_that_flip_flops_while_a_request_drains_ends_on_the_latest_address(
    make_cluster: MakeCluster,
) -> None:
    """d1 moves from A to B while a stream runs on it (its replacement waits for the
    drain), the file goes back to A, then to B again: once the stream ends d1 is at B, and
    later moves keep working."""
    c = await make_cluster(decoders=2, sim={"speed": 2.0})
    b = await start_sim_engine(SimEngineConfig(model=MODEL, speed=50.0, role="consumer"), port=0)
    try:
        state = c.state
        registry = registry_of(state)
        fleet = state.fleet
        assert fleet is not None
        a_url = c.engines["d1"].url

        def with_d1(url: str) -> dict[str, Any]:
            backends = [{**x, "url": url} if x["name"] == "d1" else x for x in configured(c)]
            return raw_of(c, backends)

        registry.set_draining("d0", True)  # the stream must land on d1
        stream = asyncio.create_task(c.stream({"model": MODEL, "prompt": long_prompt("flip", 40), "max_tokens": 40}))
        await eventually(lambda: c.engines["d1"].engine.num_running > 0 or stream.done(), what="the stream on d1")
        assert not stream.done(), stream.result()
        registry.set_draining("d0", False)

        def file_with_d1_at(url: str) -> Callable[[], Config]:
            return lambda: parse_config(with_d1(url))

        for url in (b.url, a_url, b.url):
            await reload(state, file_with_d1_at(url))
            # Between two edits of the file the router goes on serving (its tasks run).
            async with c.session.get(c.url + "/v1/models") as r:
                assert r.status == 200
        assert fleet.removing("d1")  # A drains under its stream, B waits for it
        waiting = fleet.successor("d1")
        assert waiting is not None
        assert waiting.url == b.url

        status, events = await stream
        assert status == 200
        assert events[-1] == "[DONE]"
        assert not any("error" in e for e in events[:-1])

        def d1_at(url: str) -> bool:
            s = registry.states.get("d1")
            return s is not None and s.config.url == url and s.healthy and not fleet.removing("d1")

        await eventually(lambda: d1_at(b.url), what="d1 at B")
        for url in (a_url, b.url):
            await reload(state, file_with_d1_at(url))
            await eventually(functools.partial(d1_at, url), what=f"d1 at {url}")
        registry.set_draining("d0", True)  # a request served by d1 at B
        status, out = await c.complete({"model": MODEL, "prompt": "after the flip-flop", "max_tokens": 2})
        assert status == 200, out
        registry.set_draining("d0", False)
    finally:
        await b.close()
