"""DP ranks behind one address as engines of their own (backends[].data_parallel_size):
the router places each prompt on a rank and reaches it there (X-data-parallel-rank), so a
prompt sent again finds its cache on the rank that computed it."""

from __future__ import annotations

from support.cluster import MODEL, MakeCluster, long_prompt


async def test_each_rank_is_placed_on_and_reached(make_cluster: MakeCluster) -> None:
    c = await make_cluster(
        decoders=1,
        sim={"data_parallel_size": 2},
        per_backend={"d0": {"data_parallel_size": 2}},
        routing={"strategy": "prefix_tree"},
    )
    assert sorted(c.registry.states) == ["d0-dp0", "d0-dp1"]
    prompts = [long_prompt(f"dp{i}", 200) for i in range(3)]
    for p in prompts:
        status, _ = await c.complete({"model": MODEL, "prompt": p, "max_tokens": 1})
        assert status == 200
    # Sent again, each prompt goes where the router put it, and that rank holds it. (Left to
    # the server's own balancer, which takes idle ranks in turn, 3 prompts on 2 ranks land
    # elsewhere the second time.)
    for p in prompts:
        status, out = await c.complete({"model": MODEL, "prompt": p, "max_tokens": 1})
        assert status == 200
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 190
    ranks = c.engines["d0"].server.engines
    assert all(e.stats.total_generated > 0 for e in ranks)
