"""LoRA adapters as a routing dimension: where an adapter no engine holds is loaded
(router/routing/adapters.py), and the guarantee every planner keeps: a request naming an
adapter is probed on, sent to, split onto or computed only on engines that hold it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config.schema import RoutingConfig
from router.routing.adapters import engine_for_adapter
from router.routing.fallback import plan_fallback
from router.routing.planning import RouteQuery
from router.routing.policies import POLICIES, make_strategy
from router.routing.snapshot import BackendView, ClusterSnapshot
from support.snapshots import snap, view

ADAPTERS = ("sql", "chat", "code", "legal")
BASE = "m"


def _snap(*views: BackendView) -> ClusterSnapshot:
    s = snap(*views)
    return replace(s, adapters=frozenset(a for v in views for a in v.adapters))


def _holding(name: str, adapters: tuple[str, ...], **kw: Any) -> BackendView:
    return replace(view(name, **kw), models=(BASE, *adapters), adapters=adapters)


def test_an_adapter_is_loaded_on_the_engine_predicted_soonest_with_room() -> None:
    s = _snap(
        _holding("d0", (), queued=3000),
        _holding("d1", (), queued=100),
        _holding("d2", ("sql", "chat"), queued=0),
    )
    # d2 is idle but full (2 adapters each at most): d1 has the least queued work.
    assert engine_for_adapter(s, max_per_engine=2) == "d1"
    assert engine_for_adapter(s, max_per_engine=3) == "d2"


def test_no_engine_with_room_or_available_is_none() -> None:
    s = _snap(_holding("d0", ("sql",)), _holding("d1", (), available=False))
    assert engine_for_adapter(s, max_per_engine=1) is None


def test_an_adapter_is_never_served_by_an_engine_whose_models_are_unknown() -> None:
    # An engine not yet read (models unknown) may serve the base model, never an adapter.
    s = _snap(_holding("d0", ("sql",)), replace(view("d1"), models=()))
    assert [b.name for b in s.decoders("sql")] == ["d0"]
    assert [b.name for b in s.decoders(BASE)] == ["d0", "d1"]


engine = st.fixed_dictionaries(
    {
        "adapters": st.sets(st.sampled_from(ADAPTERS)).map(lambda a: tuple(sorted(a))),
        "known": st.booleans(),  # False: its model list not read yet
        "available": st.booleans(),
        "drained": st.booleans(),
        "prefills": st.booleans(),
        "queued": st.floats(0, 20000),
        "decoding": st.floats(0, 64),
        "capable": st.booleans(),
        "fresh": st.booleans(),
        "indexed": st.floats(0, 4000),
    }
)


def _fleet(engines: list[dict[str, Any]]) -> ClusterSnapshot:
    views = []
    for i, e in enumerate(engines):
        adapters = e["adapters"] if e["known"] else ()
        v = _holding(
            f"d{i}",
            adapters,
            available=e["available"],
            prefills=e["prefills"],
            queued=e["queued"],
            decoding=e["decoding"],
        )
        if not e["known"]:
            v = replace(v, models=())
        views.append(replace(v, drained=e["drained"], threshold_capable=e["capable"], kv_events_fresh=e["fresh"]))
    return _snap(*views)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    engines=st.lists(engine, min_size=4, max_size=4),
    requests=st.lists(
        st.tuples(st.sampled_from(ADAPTERS), st.integers(0, 5), st.integers(0, 3), st.sets(st.integers(0, 3))),
        min_size=1,
        max_size=12,
    ),
    policy=st.sampled_from(sorted(POLICIES)),
)
def test_no_request_is_placed_on_an_engine_without_its_adapter(
    engines: list[dict[str, Any]], requests: list[tuple[str, int, int, set[int]]], policy: str
) -> None:
    s = _fleet(engines)
    holders = {b.name for b in s.backends if b.models}
    strategy = make_strategy(RoutingConfig(strategy=policy))
    routing = RoutingConfig()
    for adapter, prompt, remembered_on, excluded in requests:
        text = f"system prompt {prompt} " * 200
        indexed = {b.name: engines[i]["indexed"] for i, b in enumerate(s.backends) if b.kv_events_fresh}
        query = RouteQuery(model=adapter, text=text, prompt_tokens=1200, indexed=indexed, adapter=adapter)
        # The router's memory may remember any engine: one that held the adapter before
        # an unload, one that never did (the prompt sent there under another model).
        strategy.on_routed(query, f"d{remembered_on}")
        serving = {b.name for b in s.backends if adapter in b.models} & holders
        if not serving:  # held nowhere: refused at admission (404), or loaded first (autoload)
            continue
        exclude = frozenset(f"d{i}" for i in excluded)
        plan = strategy.plan(query, s, exclude)
        placed = {*plan.probes, *([plan.direct] if plan.direct else [])}
        assert placed <= serving, (adapter, placed, serving)
        if plan.cold is not None:
            assert plan.cold in serving
        hits = strategy.expected_hits(query, 1200)
        fb = plan_fallback(query, s, routing, 1200, exclude, hits)
        if fb is not None:
            assert fb.decode in serving
            assert fb.prefill is None or fb.prefill in serving
