"""Routing strategies are pure functions of (query, snapshot): tested with plain data."""
from dataclasses import replace

from hypothesis import given, strategies as st

from router.backends import BackendView, ClusterSnapshot
from router.config import RoutingConfig
from router.planning import (LeastLoadedStrategy, PrefixMemory, PrefixTreeStrategy, ProbeStrategy,
                             RoundRobinStrategy, RouteQuery, fallback_decoder, least_loaded, plan_fallback)


def view(name, *, decodes=True, prefills=False, available=True, inflight=0, running=0.0, waiting=0.0,
         kv=0.0, models=("m",)):
    return BackendView(name=name, url=f"http://{name}", decodes=decodes, prefills=prefills, models=models,
                       available=available, inflight=inflight, running=running, waiting=waiting, kv_usage=kv)


def snap(*views):
    return ClusterSnapshot(tuple(views))


Q = RouteQuery(model="m", text="hello world " * 50)
R = RoutingConfig()


def test_probe_targets_every_available_decoder_for_the_model():
    s = snap(view("d0"), view("d1"), view("down", available=False), view("p", decodes=False, prefills=True),
             view("other", models=("x",)))
    plan = ProbeStrategy(R).plan(Q, s)
    assert plan.probes == ("d0", "d1")
    assert plan.threshold == R.cache_hit_threshold
    assert plan.deadline_s == R.probe_deadline_ms / 1000
    assert ProbeStrategy(R).plan(Q, s, frozenset({"d0"})).probes == ("d1",)


def test_probe_skips_long_queues_but_never_everything():
    routing = replace(R, max_probe_waiting=4)
    s = snap(view("busy", waiting=10), view("idle", waiting=1))
    assert ProbeStrategy(routing).plan(Q, s).probes == ("idle",)
    s = snap(view("busy", waiting=10), view("busier", waiting=20))
    assert set(ProbeStrategy(routing).plan(Q, s).probes) == {"busy", "busier"}


def test_no_decoder_gives_an_empty_plan():
    s = snap(view("p", decodes=False, prefills=True))
    for strategy in (ProbeStrategy(R), RoundRobinStrategy(R), LeastLoadedStrategy(R), PrefixTreeStrategy(R)):
        assert strategy.plan(Q, s).empty


def test_round_robin_cycles():
    s = snap(view("a"), view("b"), view("c"))
    rr = RoundRobinStrategy(R)
    assert [rr.plan(Q, s).direct for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_uses_the_larger_of_inflight_and_scraped_load():
    s = snap(view("a", inflight=3), view("b", running=1, waiting=1), view("c", inflight=1, running=5))
    assert LeastLoadedStrategy(R).plan(Q, s).direct == "b"


@given(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(0, 1000))
def test_least_loaded_always_picks_a_minimum(loads, salt):
    views = [view(f"b{i}", inflight=n) for i, n in enumerate(loads)]
    assert least_loaded(views, salt).inflight == min(loads)


def test_ties_spread_with_the_salt():
    views = [view("a"), view("b"), view("c")]
    assert {least_loaded(views, salt).name for salt in range(3)} == {"a", "b", "c"}


def test_prefix_tree_routes_shared_prefixes_to_the_same_backend():
    s = snap(view("a"), view("b"))
    pt = PrefixTreeStrategy(R)
    system = "You are a helpful assistant. " * 40
    q1 = RouteQuery("m", system + "question one", salt=0)
    first = pt.plan(q1, s).direct
    pt.on_routed(q1, first)
    # Make the chosen backend slightly busier: affinity must still win below the load gate.
    loads = {first: 2}
    s2 = snap(*(view(n, inflight=loads.get(n, 0)) for n in ("a", "b")))
    for salt in range(5):
        q = RouteQuery("m", system + f"another question {salt}", salt=salt)
        assert pt.plan(q, s2).direct == first


def test_prefix_tree_load_gate_overrides_affinity():
    pt = PrefixTreeStrategy(R)
    q = RouteQuery("m", "x" * 2000)
    pt.on_routed(q, "a")
    s = snap(view("a", inflight=200), view("b", inflight=10))
    assert pt.plan(q, s).direct == "b"  # 200 - 10 > 64 and 200 > 1.5 * 10


def test_prefix_tree_low_match_goes_least_loaded():
    pt = PrefixTreeStrategy(R)
    pt.on_routed(RouteQuery("m", "a" * 640), "a")
    s = snap(view("a", inflight=2), view("b", inflight=1))
    q = RouteQuery("m", "a" * 128 + "b" * 640)  # 2 of 12 chunks match: below 0.3
    assert pt.plan(q, s).direct == "b"


def test_prefix_memory_is_bounded():
    mem = PrefixMemory(chunk_chars=4, max_entries=10)
    for i in range(50):
        mem.insert(mem.chunk_hashes(f"{i:04d}" * 3), f"b{i % 3}")
    assert len(mem._lru) <= 10
    assert sum(len(v) for v in mem._owners.values()) == len(mem._lru)


def test_fallback_prefers_prefill_decode_for_long_prompts():
    s = snap(view("d0", inflight=2), view("d1"), view("p0", decodes=False, prefills=True, inflight=1),
             view("p1", decodes=False, prefills=True))
    fb = plan_fallback(Q, s, R, prompt_tokens=R.min_pd_prompt_tokens)
    assert (fb.prefill, fb.decode, fb.route) == ("p1", "d1", "pd")
    assert fb.decode_threshold == R.decode_guard_threshold


def test_fallback_goes_direct_for_short_prompts_or_without_prefillers():
    s = snap(view("d0"), view("p0", decodes=False, prefills=True))
    fb = plan_fallback(Q, s, R, prompt_tokens=R.min_pd_prompt_tokens - 1)
    assert (fb.prefill, fb.decode, fb.decode_threshold, fb.route) == (None, "d0", 0.0, "direct")
    fb = plan_fallback(Q, snap(view("d0")), R, prompt_tokens=10_000)
    assert fb.prefill is None


def test_fallback_never_pairs_a_backend_with_itself():
    s = snap(view("both", prefills=True))
    assert plan_fallback(Q, s, R, prompt_tokens=10_000).prefill is None


def test_fallback_excludes_failed_backends():
    s = snap(view("d0"), view("d1", inflight=5), view("p0", decodes=False, prefills=True))
    fb = plan_fallback(Q, s, R, prompt_tokens=10_000, exclude=frozenset({"d0", "p0"}))
    assert (fb.decode, fb.prefill) == ("d1", None)
    assert plan_fallback(Q, s, R, 10, exclude=frozenset({"d0", "d1"})) is None


def test_fallback_skips_a_prefill_engine_busier_than_the_decoder():
    s = snap(view("d0", inflight=2), view("p0", decodes=False, prefills=True, inflight=3))
    fb = plan_fallback(Q, s, R, prompt_tokens=10_000)
    assert (fb.prefill, fb.decode, fb.route) == (None, "d0", "direct")
    s = snap(view("d0", inflight=3), view("p0", decodes=False, prefills=True, running=1, waiting=2))
    assert plan_fallback(Q, s, R, prompt_tokens=10_000).prefill == "p0"  # equal load: split


def test_fallback_decoder_weighs_the_partial_hit_against_load():
    d = [view("d0"), view("d1", inflight=1), view("d2", inflight=3)]
    # No hits reported: least loaded.
    assert fallback_decoder(d, 2000, {}, 512).name == "d0"
    # d1 lacks 2000 - 1200 = 800 tokens + 512 for its one request: 1312 < d0's 2000.
    assert fallback_decoder(d, 2000, {"d1": 1200}, 512).name == "d1"
    # A smaller hit is not worth a request in flight: 2000 - 400 + 512 > 2000.
    assert fallback_decoder(d, 2000, {"d1": 400}, 512).name == "d0"
    # load_tokens 0 follows the cache whatever the load; unknown length: least loaded.
    assert fallback_decoder(d, 2000, {"d2": 100}, 0).name == "d2"
    assert fallback_decoder(d, None, {"d2": 1900}, 512).name == "d0"


def test_fallback_goes_direct_to_a_holder_that_lacks_little_and_splits_otherwise():
    s = snap(view("d0"), view("d1"), view("p0", decodes=False, prefills=True))
    # d1 holds most of the prompt: the rest (100 < min_pd_prompt_tokens) is computed there.
    fb = plan_fallback(Q, s, R, prompt_tokens=1000, hits={"d1": 900})
    assert (fb.decode, fb.prefill, fb.route) == ("d1", None, "direct")
    # d1 holds a little: prefill/decode, decoded where the partial hit is.
    fb = plan_fallback(Q, s, R, prompt_tokens=5000, hits={"d1": 1000})
    assert (fb.decode, fb.prefill, fb.route) == ("d1", "p0", "pd")


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 4000)), min_size=1, max_size=6),
       st.integers(1, 4000), st.integers(0, 2000))
def test_fallback_decoder_is_the_cost_minimum(loads_hits, prompt, load_tokens):
    d = [view(f"d{i}", inflight=load) for i, (load, _) in enumerate(loads_hits)]
    hits = {f"d{i}": min(hit, prompt) for i, (_, hit) in enumerate(loads_hits) if hit}
    chosen = fallback_decoder(d, prompt, hits, load_tokens)

    def cost(b):
        return prompt - hits.get(b.name, 0) + load_tokens * b.load

    assert cost(chosen) == min(cost(b) for b in d)


def test_probe_strategy_expects_hits_where_it_sent_a_prefix():
    s = ProbeStrategy(R)
    leader = RouteQuery(model="m", text="system prompt " * 40 + "question one")
    s.on_routed(leader, "d1")
    follower = RouteQuery(model="m", text="system prompt " * 40 + "another question")
    hits = s.fallback_hits(follower, 1000, {"d0": 100})
    # The shared head is ~560 of ~576 characters: most of the 1,000 tokens, expected on d1.
    assert hits["d0"] == 100 and 850 <= hits["d1"] < 1000
    # What an engine reported wins when it is larger; unknown length: only the reports.
    assert s.fallback_hits(follower, 1000, {"d1": 990})["d1"] == 990
    assert s.fallback_hits(follower, None, {"d0": 5}) == {"d0": 5}
    assert s.fallback_hits(RouteQuery(model="m", text="unrelated " * 60), 1000, {}) == {}


def test_a_drained_backend_is_never_planned_even_as_panic_routing():
    drained = replace(view("d0"), available=False, drained=True)
    # Panic routing: with no decoder available, every decoder of the model is tried...
    assert [b.name for b in snap(view("d0", available=False), view("d1", available=False)).decoders("m")] \
        == ["d0", "d1"]
    # ...except one an operator drained.
    assert [b.name for b in snap(drained, view("d1", available=False)).decoders("m")] == ["d1"]
    assert ProbeStrategy(R).plan(Q, snap(drained)).empty
    assert plan_fallback(Q, snap(drained, view("p", decodes=False, prefills=True)), R, 1000) is None


def test_max_probes_keeps_the_prompt_holders_then_the_least_loaded():
    routing = replace(R, max_probes=2)
    strategy = ProbeStrategy(routing)
    decoders = (view("d0", inflight=3), view("d1", inflight=1), view("d2", inflight=5), view("d3", inflight=0))
    # Nothing known of the prompt: the two least loaded.
    assert set(strategy.plan(Q, snap(*decoders)).probes) == {"d3", "d1"}
    # The router sent this prompt to d2 (busiest): it is probed first, then the least loaded.
    strategy.on_routed(Q, "d2")
    assert strategy.plan(Q, snap(*decoders)).probes == ("d2", "d3")
    # Another prompt is not affected by that memory.
    other = RouteQuery(model="m", text="something else entirely " * 30)
    assert set(strategy.plan(other, snap(*decoders)).probes) == {"d3", "d1"}
    # No bound, or a bound at least the fleet's size: every decoder, in configuration order.
    assert ProbeStrategy(R).plan(Q, snap(*decoders)).probes == ("d0", "d1", "d2", "d3")
    assert ProbeStrategy(replace(R, max_probes=4)).plan(Q, snap(*decoders)).probes == ("d0", "d1", "d2", "d3")
