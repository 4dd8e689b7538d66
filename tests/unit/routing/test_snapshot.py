"""The snapshot a planner reads (router/routing/snapshot.py): panic routing and drained backends."""

from __future__ import annotations

from dataclasses import replace

from router.routing.fallback import plan_fallback
from router.routing.policies.probe import ProbeStrategy
from support.snapshots import Q, R, snap, view


def test_a_drained_backend_is_never_planned_even_as_panic_routing() -> None:
    drained = replace(view("d0"), available=False, drained=True)
    # Panic routing: with no decoder available, every decoder of the model is tried...
    assert [b.name for b in snap(view("d0", available=False), view("d1", available=False)).decoders("m")] == [
        "d0",
        "d1",
    ]
    # ...except one an operator drained.
    assert [b.name for b in snap(drained, view("d1", available=False)).decoders("m")] == ["d1"]
    assert ProbeStrategy(R).plan(Q, snap(drained)).empty
    assert plan_fallback(Q, snap(drained, view("p", decodes=False, prefills=True)), R, 1000) is None
