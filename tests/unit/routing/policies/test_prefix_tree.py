"""The `prefix_tree` strategy (router/routing/policies/prefix_tree.py): prefix affinity
weighed against the holder's queue."""

from __future__ import annotations

from router.routing.planning import RouteQuery
from router.routing.policies.prefix_tree import PrefixTreeStrategy
from support.snapshots import R, snap, view


def test_prefix_tree_routes_shared_prefixes_to_the_same_backend() -> None:
    s = snap(view("a"), view("b"))
    pt = PrefixTreeStrategy(R)
    system = "You are a helpful assistant. " * 40
    q1 = RouteQuery("m", system + "question one", salt=0)
    first = pt.plan(q1, s).direct
    assert first is not None
    pt.on_routed(q1, first)
    # The holder is somewhat busier: what it holds saves more than its queue costs.
    s2 = snap(*(view(n, queued=100 if n == first else 0) for n in ("a", "b")))
    for salt in range(5):
        q = RouteQuery("m", system + f"another question {salt}", salt=salt)
        assert pt.plan(q, s2).direct == first


def test_prefix_tree_leaves_the_holder_when_its_queue_costs_more_than_the_hit_saves() -> None:
    pt = PrefixTreeStrategy(R)
    q = RouteQuery("m", "x" * 4000, prompt_tokens=1000)
    pt.on_routed(q, "a")
    s = snap(view("a", queued=5000), view("b", queued=100))
    assert pt.plan(q, s).direct == "b"  # 5,000 + 0 tokens vs 100 + 1,000
    s = snap(view("a", queued=900), view("b", queued=100))
    assert pt.plan(q, s).direct == "a"  # 900 + 0 vs 100 + 1,000
