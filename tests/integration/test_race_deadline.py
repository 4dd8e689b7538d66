"""The probe deadline: silent engines expire and are cancelled; the fallback starts."""

import asyncio

from support.cluster import MODEL, MakeCluster, long_prompt
from support.polling import eventually


async def test_silent_busy_engine_expires_and_is_cancelled(make_cluster: MakeCluster) -> None:
    # d0 checks the threshold only at admission (like plain vLLM) and its single running
    # slot is taken by a long generation: a probe to it waits in its queue, silent.
    c = await make_cluster(
        decoders=2,
        prefillers=0,
        routing={"probe_deadline_ms": 100, "probe_deadline_per_token_ms": 0},
        sim={"speed": 5.0},
        per_engine={"d0": {"arrival_check": False, "max_num_seqs": 1}},
    )
    hog = asyncio.create_task(
        c.session.post(
            c.engines["d0"].url + "/v1/completions",
            json={"model": MODEL, "prompt": "hog", "max_tokens": 3000, "ignore_eos": True},
        )
    )
    await eventually(lambda: c.engines["d0"].engine.num_running == 1, what="the hog running on d0", interval=0.01)
    status, out = await c.complete({"model": MODEL, "prompt": long_prompt("deadline", 200), "max_tokens": 4})
    assert status == 200, out
    assert c.router_metric("cachehit_router_probe_deadline_expiries_total", backend="d0") == 1
    assert c.router_metric("cachehit_router_probe_rejections_total", backend="d1") == 1
    assert c.routes()["direct"] == 1
    # The expired probe was dropped from d0's queue; only the hog remains there.
    await eventually(
        lambda: c.engines["d0"].engine.num_waiting == 0, what="the expired probe dropped from d0's queue", interval=0.01
    )
    assert c.engines["d1"].engine.num_running == 0
    hog.cancel()
    await asyncio.gather(hog, return_exceptions=True)


async def test_prompt_length_extends_the_deadline_for_a_prefilling_acceptor(make_cluster: MakeCluster) -> None:
    """d0 holds half of a long prompt; prefilling the other half (4,000 tokens: ~0.2 s at the
    default timing) takes longer than the base deadline (0.1 s), but d1's rejection reports
    the prompt length and the deadline grows by (1 - T) * tokens * per_token."""
    c = await make_cluster(
        decoders=2,
        prefillers=0,
        routing={"probe_deadline_ms": 100, "probe_deadline_per_token_ms": 0.5, "cache_hit_threshold": 0.4},
        sim={"speed": 1.0},
    )
    shared = long_prompt("half", 4000)
    async with c.session.post(
        c.engines["d0"].url + "/v1/completions", json={"model": MODEL, "prompt": shared, "max_tokens": 1}
    ) as r:
        assert r.status == 200
    status, out = await c.complete(
        {"model": MODEL, "prompt": shared + " " + long_prompt("rest", 4000), "max_tokens": 2}
    )
    assert status == 200, out
    assert c.routes()["probe_hit"] == 1
    assert c.router_metric_or_zero("cachehit_router_probe_deadline_expiries_total", backend="d0") == 0


async def test_fallback_never_picks_an_engine_whose_probe_expired(make_cluster: MakeCluster) -> None:
    # d0 is silent (its only running slot is taken and it checks the threshold only at
    # admission: a stopped or stuck engine looks the same), d1 answers. By the cost model d0
    # would compute the prompt sooner (d1 is configured 100x slower), but an engine that
    # let its probe expire is not responding: the prompt goes to d1.
    c = await make_cluster(
        decoders=2,
        prefillers=0,
        routing={"probe_deadline_ms": 100},
        sim={"speed": 5.0},
        per_engine={"d0": {"arrival_check": False, "max_num_seqs": 1}},
        per_backend={"d1": {"prefill_tokens_per_s": 100.0}},
    )
    hog = asyncio.create_task(
        c.session.post(
            c.engines["d0"].url + "/v1/completions",
            json={"model": MODEL, "prompt": "hog", "max_tokens": 3000, "ignore_eos": True},
        )
    )
    await eventually(lambda: c.engines["d0"].engine.num_running == 1, what="the hog running on d0", interval=0.01)
    status, out = await c.complete({"model": MODEL, "prompt": long_prompt("stuck", 200), "max_tokens": 4})
    assert status == 200, out
    assert c.router_metric("cachehit_router_probe_deadline_expiries_total", backend="d0") == 1
    assert c.routes()["direct"] == 1
    assert await c.engine_metric("d1", "vllm:generation_tokens_total") == 4
    hog.cancel()
    await asyncio.gather(hog, return_exceptions=True)
