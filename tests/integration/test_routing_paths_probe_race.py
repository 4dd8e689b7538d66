"""The probe race's choices, against simulated engines: a follower of a cold prompt joining
its leader, max_probes asking the prompt holder and the next soonest, and a prefix in an
engine's CPU tier winning, cold prompts arriving together spread while the KV-event index
is asked. Read from the engines' own state and metrics and the router's
request log, never from the router's word alone.
"""

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from support.cluster import MODEL, Cluster, MakeCluster, long_prompt, registry_of
from support.kv_publisher import KvPublisher
from support.polling import eventually


async def test_a_follower_of_a_cold_prompt_joins_its_leader_when_that_is_sooner(make_cluster: MakeCluster) -> None:
    # A (2,000-token head) goes to one engine, C (another 2,000 tokens) to the other; B
    # shares A's head and arrives while both are computing, so every engine rejects B. The
    # router remembers where it sent A: there B lacks 10 tokens behind A's 2,010, on C's
    # engine it would lack 2,010 behind C's 2,010, so B joins A and reuses its blocks.
    c = await make_cluster(decoders=2, prefillers=0, routing={"race": "always"}, sim={"speed": 0.5})
    head = long_prompt("leader", 2000)
    leader = asyncio.create_task(
        c.complete({"model": MODEL, "prompt": head + " " + long_prompt("a", 10), "max_tokens": 2})
    )
    await eventually(lambda: any(c.engine_running().values()), what="A's leg on an engine", interval=0.002)
    other = asyncio.create_task(c.complete({"model": MODEL, "prompt": long_prompt("other", 2010), "max_tokens": 2}))
    await eventually(lambda: sum(c.engine_running().values()) >= 2, what="C's leg on the other engine", interval=0.002)
    status, b = await c.complete({"model": MODEL, "prompt": head + " " + long_prompt("b", 10), "max_tokens": 2})
    (status_a, a), (status_c, _) = await leader, await other
    assert status == 200, (a, b)
    assert status_a == 200, (a, b)
    assert status_c == 200, (a, b)
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 2000, b["usage"]
    assert c.routes()["pd"] == 0


async def test_max_probes_asks_the_prompt_holder_and_the_next_soonest(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=4, routing={"max_probes": 2, "race": "always"}, sim={"speed": 1.0})
    warm = {"model": MODEL, "prompt": long_prompt("bounded", 300), "max_tokens": 2}
    status, out = await c.complete(warm)  # cold: the two probes reject, the fallback computes it
    assert status == 200, out
    generated = await c.engine_metrics("vllm:generation_tokens_total")
    holder = next(n for n, v in generated.items() if v > 0)
    seen = await c.engine_metrics("vllm:request_success_total")  # rejections included
    assert sum(seen.values()) == 3

    def refused_or_dropped() -> float:  # probes that did not win
        return sum(
            c.router_metric_or_zero(m, backend=n)
            for n in c.engines
            for m in ("cachehit_router_probe_rejections_total", "cachehit_router_probe_losers_total")
        )

    assert refused_or_dropped() == 2

    for _ in range(3):
        before = await c.engine_metrics("vllm:request_success_total")
        status, out = await c.complete(warm)
        assert status == 200, out
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 288  # whole blocks
        after = await c.engine_metrics("vllm:request_success_total")
        asked = {n for n in after if after[n] > before[n]}
        assert len(asked) == 2, asked
        assert holder in asked, asked  # two probes, the holder among them
    assert c.routes()["probe_hit"] == 3
    assert refused_or_dropped() == 2 + 3  # each warm request: the holder wins, the other does not


def _evicting_prompts(tag: str) -> list[str]:
    # Two 900-token prompts: after them nothing of an earlier prompt is left in a 60-block
    # (944-token) GPU cache.
    return [long_prompt(f"{tag}{i}", 900) for i in range(2)]


async def test_a_prefix_in_an_engines_cpu_tier_wins_the_probe_race_and_is_reported(
    make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    # Both decoders computed P, then evicted it from their small GPU caches; d0 keeps P in its
    # CPU tier (vLLM's OffloadingConnector), d1 has none. At T = 0.5 the GPU-only engine
    # rejects and d0 accepts: only the engine knew it still held P.
    small = {"num_gpu_blocks": 60, "max_model_len": 2048}
    c = await make_cluster(
        decoders=2,
        prefillers=0,
        routing={"race": "always"},
        per_engine={"d0": {**small, "cpu_offload_tokens": 4096}, "d1": small},
    )
    p = long_prompt("offloaded", 300)
    for name in ("d0", "d1"):
        for prompt in [p, *_evicting_prompts("evict")]:
            async with c.session.post(
                c.engines[name].url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
            ) as r:
                assert r.status == 200
    await c.wait_all_healthy()
    status, out = await c.complete({"model": MODEL, "prompt": p, "max_tokens": 2})
    assert status == 200, out
    assert c.routes() == {"probe_hit": 1, "pd": 0, "direct": 0}
    assert c.router_metric("cachehit_router_probe_rejections_total", backend="d1") == 1
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 288
    assert await c.engine_metric("d0", "vllm:prompt_tokens_cached_by_source_total") >= 288
    assert c.engines["d0"].engine.cpu.loaded_blocks >= 18

    # P and 400 new tokens (P is 41% < T): both reject, each rejection says what it holds
    # (d0: P's blocks in host memory), the request log line carries it, and the prompt is
    # computed where its prefix is.
    q = p + " " + long_prompt("more", 400)
    for name in ("d0", "d1"):
        for prompt in _evicting_prompts("again"):
            async with c.session.post(
                c.engines[name].url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
            ) as r:
                assert r.status == 200
    with caplog.at_level(logging.INFO, logger="cachehit_router.requests"):
        status, out = await c.complete({"model": MODEL, "prompt": q, "max_tokens": 2})
    assert status == 200, out
    # The request log's record, passed as `extra`: an attribute of the LogRecord.
    lines = [r.__dict__["request"] for r in caplog.records if r.name == "cachehit_router.requests"]
    assert lines[-1]["rejected_hits"]["d1"] == 0
    assert lines[-1]["rejected_hits"]["d0"] == 288
    assert lines[-1]["route"] == "direct"
    assert lines[-1]["winner"] == "d0"
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 288


@pytest.fixture
async def publishers() -> AsyncIterator[list[KvPublisher]]:
    pubs = [KvPublisher(), KvPublisher()]
    yield pubs
    for p in pubs:
        p.close()


async def with_live_index(make_cluster: MakeCluster, pubs: list[KvPublisher]) -> Cluster:
    """Two decoders whose KV-event streams (one publisher each) are live and hold nothing."""
    c = await make_cluster(
        decoders=2,
        per_backend={
            f"d{i}": {"kv_events_endpoint": p.endpoint, "kv_events_replay_endpoint": p.replay_endpoint}
            for i, p in enumerate(pubs)
        },
    )
    assert c.state.kv_events is not None
    streams = c.state.kv_events.streams

    def live() -> bool:
        for p in pubs:
            p.publish()  # an empty batch: ZMQ drops what is sent before the socket joined
        return all(s.synced and s.last_live is not None for s in streams.values())

    await eventually(live, what="both engines' streams live")
    return c


async def test_probe_spreads_cold_prompts_that_arrive_together_while_the_index_is_asked(
    make_cluster: MakeCluster, publishers: list[KvPublisher]
) -> None:
    # Each cold prompt waits for its /tokenize round trip before it is planned. Planned in
    # the fleet as it was before that wait, both went to the same engine; planned after
    # it, the second sees the first.
    c = await with_live_index(make_cluster, publishers)
    bodies = [{"model": MODEL, "prompt": long_prompt(f"cold{i}", 400), "max_tokens": 2} for i in range(2)]
    results = await asyncio.gather(*(c.stream(b) for b in bodies))
    assert [status for status, _ in results] == [200, 200]
    assert c.routes()["direct"] == 2
    served = await c.engine_metrics("vllm:request_success_total")
    assert served == {"d0": 1, "d1": 1}


async def test_a_cold_prompt_the_index_knows_teaches_the_engines_speed_at_its_first_token(
    make_cluster: MakeCluster, publishers: list[KvPublisher]
) -> None:
    # The prompt tokenized and nothing held anywhere: what its engine lacks is known when
    # it is sent, so its time to first token is a speed sample as soon as the token is
    # relayed, not when the answer's usage arrives at its end.
    c = await with_live_index(make_cluster, publishers)
    learner = registry_of(c.state).learner
    body = {"model": MODEL, "prompt": long_prompt("teach", 400), "max_tokens": 40, "stream": True}
    async with await c.post("/v1/completions", body) as r:
        assert r.status == 200
        first = await r.content.readline()
        assert first.startswith(b"data: {"), first
        taught = {name: fit.samples for name, fit in learner._engines.items()}
        rest = await r.read()
    assert sorted(taught.values()) == [1]  # one engine, one sample, the answer still streaming
    assert rest.rstrip().endswith(b"data: [DONE]")
    assert {name: fit.samples for name, fit in learner._engines.items()} == taught  # not again at its end
