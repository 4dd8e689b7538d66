"""The threshold capability check (router/fleet/capability.py): an engine that accepts a probe at
T = 1.0 on a random prompt (a stock vLLM; the simulator with threshold_plugin off) is
routed to without probes, with a warning and cachehit_router_backend_threshold_capable."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from engine_launcher.sim import start_sim_engine
from support.cluster import MODEL, Cluster, MakeCluster, long_prompt
from support.polling import eventually

GAUGE = "cachehit_router_backend_threshold_capable"


async def _checked(c: Cluster, within: float = 10.0) -> dict[str, float]:
    def checked() -> dict[str, float]:
        values = {n: c.router_metric(GAUGE, backend=n) for n in c.engines}
        assert all(v != -1 for v in values.values()), values
        assert all(s.threshold_capable is not None for s in c.registry.states.values()), values
        return values

    return await eventually(checked, within, "the capability check of every engine")


async def test_stock_engine_is_never_probed(make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cachehit_router")
    c = await make_cluster(decoders=2, routing={"race": "always"}, per_engine={"d0": {"threshold_plugin": False}})
    assert await _checked(c) == {"d0": 0.0, "d1": 1.0}
    assert any(
        "backend d0: accepted a probe at cache_hit_threshold = 1.0" in r.getMessage() and r.levelno == logging.WARNING
        for r in caplog.records
    )
    # Cold prompts: probed, the stock engine would accept each one and win every race.
    for i in range(4):
        status, out = await c.complete({"model": MODEL, "prompt": long_prompt(f"stock{i}", 40), "max_tokens": 2})
        assert status == 200, out
    assert c.routes()["probe_hit"] == 0
    assert c.router_metric("cachehit_router_probe_rejections_total", backend="d1") == 4
    assert c.router_metric_or_zero("cachehit_router_probe_rejections_total", backend="d0") == 0
    assert c.router_metric_or_zero("cachehit_router_probe_losers_total", backend="d0") == 0
    # A prompt d1 holds is still found by the race.
    prompt = long_prompt("stock-warm", 40)
    async with c.session.post(
        c.engines["d1"].url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
    ) as r:
        assert r.status == 200
    status, _ = await c.complete({"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert status == 200
    assert c.routes()["probe_hit"] == 1


async def test_only_stock_engines_are_served_directly(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, sim={"threshold_plugin": False})
    assert await _checked(c) == {"d0": 0.0, "d1": 0.0}
    for stream in (False, True):
        if stream:
            status, events = await c.stream({"model": MODEL, "prompt": "hello", "max_tokens": 3})
            assert status == 200
            assert events[-1] == "[DONE]"
        else:
            status, out = await c.complete({"model": MODEL, "prompt": "hello", "max_tokens": 3})
            assert status == 200
            assert out["usage"]["completion_tokens"] == 3
    assert c.routes() == {"probe_hit": 0, "pd": 0, "direct": 2}


async def test_a_backend_back_from_down_is_checked_again(make_cluster: MakeCluster) -> None:
    """The engine behind a backend's URL goes away and a stock one takes its port."""
    c = await make_cluster(decoders=1)
    assert await _checked(c) == {"d0": 1.0}
    old = c.engines["d0"]
    port = old.port
    await old.close()
    await eventually(lambda: c.router_metric(GAUGE, backend="d0") == -1, 10, "d0 down: its capability forgotten")
    c.engines["d0"] = await start_sim_engine(replace(old.config, threshold_plugin=False), port=port)
    assert await _checked(c) == {"d0": 0.0}
