"""DP ranks behind one address as engines of their own (backends[].data_parallel_size):
the router places each prompt on a rank and reaches it there (X-data-parallel-rank), so a
prompt sent again finds its cache on the rank that computed it."""

from __future__ import annotations

import logging

import pytest

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


async def test_undeclared_ranks_are_named_in_a_warning(
    make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM labels each rank's metrics engine="<rank>": the router sees the ranks it was not told of.
    caplog.set_level(logging.WARNING, logger="cachehit_router.health")
    c = await make_cluster(decoders=1, sim={"data_parallel_size": 2})
    assert list(c.registry.states) == ["d0"]
    warned = [r.getMessage() for r in caplog.records if "DP ranks" in r.getMessage()]
    assert warned == ["backend d0: 2 DP ranks behind one address; data_parallel_size = 2 routes each"]
