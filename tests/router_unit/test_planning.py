"""Routing strategies are pure functions of (query, snapshot): tested with plain data.

Every load- or cache-aware choice is the least predicted time to first token of the cost
model (router/routing/costmodel.py); these tests use one known engine speed so that each expected
choice can be worked out by hand from the formula."""

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from router.config.schema import RoutingConfig
from router.names import Mode
from router.routing.costmodel import EngineSpeed, TransferSpeed, pd_ttft, ttft
from router.routing.fallback import plan_fallback
from router.routing.planning import RouteQuery, fastest, predicted_ttft, race_value
from router.routing.policies.least_loaded import LeastLoadedStrategy
from router.routing.policies.prefix_tree import PrefixTreeStrategy
from router.routing.policies.probe import EXPLORE_ONE_IN, ProbeSettings, ProbeStrategy
from router.routing.policies.round_robin import RoundRobinStrategy
from router.routing.prefix_memory import PrefixMemory
from router.routing.snapshot import BackendView, ClusterSnapshot

# 10 ms per step, 100 us per prompt token (10k tokens/s), 1 ms per decoding sequence.
SPEED = EngineSpeed(intercept_s=0.01, per_token_s=1e-4, per_decode_s=1e-3)


def view(
    name,
    *,
    decodes=True,
    prefills=False,
    available=True,
    inflight=0,
    running=0.0,
    waiting=0.0,
    kv=0.0,
    models=("m",),
    queued=0.0,
    decoding=0.0,
    speed=SPEED,
):
    return BackendView(
        name=name,
        url=f"http://{name}",
        decodes=decodes,
        prefills=prefills,
        models=models,
        available=available,
        inflight=inflight,
        running=running,
        waiting=waiting,
        kv_usage=kv,
        queued_tokens=queued,
        decoding=decoding,
        speed=speed,
    )


def snap(*views, transfer=TransferSpeed(0.005, 1e-5), race_wait_s=0.002, race_saving_share=0.5):
    # Races measured alike for prompts the memory places and prompts it does not.
    return ClusterSnapshot(
        tuple(views),
        transfer=transfer,
        chars_per_token=4.0,
        race_wait_s=race_wait_s,
        race_saving_share=race_saving_share,
        race_saving_share_unplaced=race_saving_share,
    )


Q = RouteQuery(model="m", text="hello world " * 100, prompt_tokens=1000)
R = RoutingConfig()


def test_probe_targets_every_available_decoder_for_the_model():
    s = snap(
        view("d0"),
        view("d1"),
        view("down", available=False),
        view("p", decodes=False, prefills=True),
        view("other", models=("x",)),
    )
    plan = ProbeStrategy(R).plan(Q, s)
    assert plan.probes == ("d0", "d1")
    assert plan.threshold == ProbeSettings().cache_hit_threshold
    # Deadline: the floor plus twice the slowest acceptor's predicted time (it lacks at most
    # (1 - T) of the prompt).
    acceptor = SPEED.ttft((1 - ProbeSettings().cache_hit_threshold) * 1000, 0)
    assert plan.probe_ttft_s == (acceptor, acceptor)
    assert abs(plan.deadline_s - (ProbeSettings().probe_deadline_ms / 1000 + 2 * acceptor)) < 1e-9
    assert ProbeStrategy(R).plan(Q, s, frozenset({"d0"})).probes == ("d1",)


def test_probe_skips_long_queues_but_never_everything():
    routing = ProbeSettings(max_probe_waiting=4)
    s = snap(view("busy", waiting=10), view("idle", waiting=1))
    assert ProbeStrategy(R, routing).plan(Q, s).probes == ("idle",)
    s = snap(view("busy", waiting=10), view("busier", waiting=20))
    assert set(ProbeStrategy(R, routing).plan(Q, s).probes) == {"busy", "busier"}


def test_probe_skips_an_engine_that_even_as_an_acceptor_is_slower_than_computing_elsewhere():
    # d0 has 3,000 tokens queued: as an acceptor it would prefill 500 + 3,000 = 3,500 tokens,
    # while d1 computes the whole prompt (1,000) now. Waiting for d0 can only cost time.
    # (So even if the memory says d0 holds the prompt: 3,000 + 0 > 1,000.)
    s = snap(view("d0", queued=3000), view("d1"))
    assert ProbeStrategy(R).plan(Q, s).probes == ("d1",)
    # A smaller queue (400 + 500 < 1,000): d0 may still win as an acceptor, so it is asked.
    s = snap(view("d0", queued=400), view("d1"))
    assert ProbeStrategy(R).plan(Q, s).probes == ("d0", "d1")


def test_probe_goes_straight_to_the_cold_choice_when_no_hit_could_pay_for_the_race():
    # 10 tokens: a hit saves at most 1 ms, the verdicts cost 2 ms.
    short = RouteQuery("m", "hi there", prompt_tokens=10)
    plan = ProbeStrategy(R).plan(short, snap(view("d0", queued=50), view("d1")))
    assert (plan.probes, plan.direct, plan.prefill_tokens) == ((), "d1", 10)
    assert plan.predicted_ttft_s == SPEED.ttft(10, 0)
    # Engines whose verdicts are slow (no arrival check: a rejection waits in the queue)
    # make even a 1,000-token prompt not worth racing.
    plan = ProbeStrategy(R).plan(Q, snap(view("d0"), view("d1"), race_wait_s=0.5))
    assert plan.direct is not None
    assert not plan.probes
    # Skipped, not merely direct: the dispatcher weighs a prefill/decode split for it.
    assert plan.skipped_race
    # An operator who wants every request raced says so.
    always = ProbeStrategy(R, ProbeSettings(race=Mode.ALWAYS))
    assert always.plan(short, snap(view("d0", queued=50), view("d1"))).probes == ("d1",)
    assert always.plan(Q, snap(view("d0"), view("d1"), race_wait_s=0.5)).probes == ("d0", "d1")


def test_probe_races_only_where_races_have_been_paying_off_but_keeps_exploring():
    s_paying = snap(view("d0"), view("d1"), race_wait_s=0.01, race_saving_share=0.5)
    s_idle = snap(view("d0"), view("d1"), race_wait_s=0.01, race_saving_share=0.05)
    # 1,000 tokens: 0.1 s of prefill. Races saving half of it (0.05 s) beat a 0.01 s wait;
    # races saving 5% (0.005 s) do not, except one request in EXPLORE_ONE_IN (by its salt).
    for salt in range(1, 16):
        q = RouteQuery("m", Q.text, salt=salt, prompt_tokens=1000)
        assert ProbeStrategy(R).plan(q, s_paying).probes == ("d0", "d1")
        assert ProbeStrategy(R).plan(q, s_idle).direct is not None
    explorer = RouteQuery("m", Q.text, salt=EXPLORE_ONE_IN * 3, prompt_tokens=1000)
    assert ProbeStrategy(R).plan(explorer, s_idle).probes == ("d0", "d1")
    # A long prompt is worth racing even where races rarely pay: 5% of 1 s > 0.01 s.
    long_q = RouteQuery("m", Q.text, salt=1, prompt_tokens=10_000)
    assert ProbeStrategy(R).plan(long_q, s_idle).probes == ("d0", "d1")


def test_race_value_is_what_the_outcome_saved_over_the_cold_choice():
    s = snap(view("d0", queued=500), view("d1", queued=600))
    plan = ProbeStrategy(R).plan(Q, s)
    assert plan.cold == "d0"
    assert plan.probes == ("d0", "d1")
    share = lambda winner, chosen, reported: race_value(plan, s, 1000, {}, winner, chosen, reported)
    assert share("d0", None, {}) == 0.0  # the cold choice itself accepted
    # d1 accepted: as an acceptor (600 + 500 tokens) vs d0 computing it all (500 + 1,000).
    assert abs(share("d1", None, {}) - (SPEED.ttft(1500, 0) - SPEED.ttft(1100, 0)) / 0.1) < 1e-9
    # Nobody accepted; the fallback's choice is predicted 0.03 s sooner than the cold choice.
    assert abs(share(None, SPEED.ttft(1500, 0) - 0.03, {"d0": 0.0}) - 0.3) < 1e-9
    # The memory thought d0 held the prompt; its rejection says it holds nothing: judged
    # by the truth, the race saved what going to d0 would have cost.
    stale = race_value(plan, s, 1000, {"d0": 1000.0}, None, SPEED.ttft(600, 0), {"d0": 0.0})
    assert abs(stale - (SPEED.ttft(1500, 0) - SPEED.ttft(600, 0)) / 0.1) < 1e-9


def test_no_decoder_gives_an_empty_plan():
    s = snap(view("p", decodes=False, prefills=True))
    for strategy in (ProbeStrategy(R), RoundRobinStrategy(R), LeastLoadedStrategy(R), PrefixTreeStrategy(R)):
        assert strategy.plan(Q, s).empty


def test_round_robin_cycles_and_still_reports_the_model_prediction():
    s = snap(view("a"), view("b", queued=500), view("c"))
    rr = RoundRobinStrategy(R)
    plans = [rr.plan(Q, s) for _ in range(6)]
    assert [p.direct for p in plans] == ["a", "b", "c", "a", "b", "c"]
    assert plans[1].predicted_ttft_s == SPEED.ttft(1500, 0)
    assert plans[1].prefill_tokens == 1000


def test_least_loaded_counts_tokens_not_requests():
    # "a": two short prompts queued (200 tokens); "b": one long one (4,000): b looks less
    # loaded by request count, but a delivers the first token sooner.
    s = snap(view("a", inflight=2, queued=200), view("b", inflight=1, queued=4000))
    assert LeastLoadedStrategy(R).plan(Q, s).direct == "a"
    # Decoding sequences slow every step: 50 decoding (50 ms) outweigh 300 queued tokens (30 ms).
    s = snap(view("a", decoding=50), view("b", queued=300))
    assert LeastLoadedStrategy(R).plan(Q, s).direct == "b"
    # A slower engine (half the prefill speed) loses at equal load.
    slow = EngineSpeed(0.01, 2e-4, 1e-3)
    assert LeastLoadedStrategy(R).plan(Q, snap(view("a", speed=slow), view("b"))).direct == "b"


@given(st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 64)), min_size=1, max_size=6), st.integers(0, 1000))
def test_least_loaded_always_picks_a_least_predicted_time(loads, salt):
    views = [view(f"b{i}", queued=q, decoding=d) for i, (q, d) in enumerate(loads)]
    q = RouteQuery("m", "x", salt=salt, prompt_tokens=500)
    chosen = LeastLoadedStrategy(R).plan(q, snap(*views))
    assert chosen.predicted_ttft_s == min(predicted_ttft(v, 500) for v in views)


def test_ties_spread_with_the_salt():
    views = [view("a"), view("b"), view("c")]
    assert {fastest(views, lambda b: 100, salt)[0].name for salt in range(3)} == {"a", "b", "c"}


def test_prefix_tree_routes_shared_prefixes_to_the_same_backend():
    s = snap(view("a"), view("b"))
    pt = PrefixTreeStrategy(R)
    system = "You are a helpful assistant. " * 40
    q1 = RouteQuery("m", system + "question one", salt=0)
    first = pt.plan(q1, s).direct
    pt.on_routed(q1, first)
    # The holder is somewhat busier: what it holds saves more than its queue costs.
    s2 = snap(*(view(n, queued=100 if n == first else 0) for n in ("a", "b")))
    for salt in range(5):
        q = RouteQuery("m", system + f"another question {salt}", salt=salt)
        assert pt.plan(q, s2).direct == first


def test_prefix_tree_leaves_the_holder_when_its_queue_costs_more_than_the_hit_saves():
    pt = PrefixTreeStrategy(R)
    q = RouteQuery("m", "x" * 4000, prompt_tokens=1000)
    pt.on_routed(q, "a")
    s = snap(view("a", queued=5000), view("b", queued=100))
    assert pt.plan(q, s).direct == "b"  # 5,000 + 0 tokens vs 100 + 1,000
    s = snap(view("a", queued=900), view("b", queued=100))
    assert pt.plan(q, s).direct == "a"  # 900 + 0 vs 100 + 1,000


def test_prefix_memory_is_bounded():
    mem = PrefixMemory(chunk_chars=4, max_entries=10)
    for i in range(50):
        mem.insert(mem.chunk_hashes(f"{i:04d}" * 3), f"b{i % 3}")
    assert len(mem._lru) <= 10
    assert sum(len(v) for v in mem._owners.values()) == len(mem._lru)


def test_fallback_splits_when_prefill_decode_is_predicted_faster():
    # d0 is busy (2,000 queued), d1 busier: the producer prefills in parallel with d1's queue.
    s = snap(
        view("d0", queued=2000),
        view("d1", queued=2500),
        view("p0", decodes=False, prefills=True, queued=500),
        view("p1", decodes=False, prefills=True),
    )
    fb = plan_fallback(Q, s, R, prompt_tokens=1000)
    direct = SPEED.ttft(3000, 0)
    split = pd_ttft(SPEED, 0, 0, 1000, SPEED, 2000, 0, s.transfer, 1000)
    assert split < direct
    assert (fb.prefill, fb.decode, fb.route, fb.prefill_tokens) == ("p1", "d0", "pd", 1000)
    assert fb.decode_threshold == R.decode_guard_threshold
    assert fb.predicted_ttft_s == split


def test_fallback_computes_on_an_idle_decoder_rather_than_split():
    # Idle decoder: computing the prompt there beats prefill + transfer (same speed).
    s = snap(view("d0"), view("p0", decodes=False, prefills=True))
    fb = plan_fallback(Q, s, R, prompt_tokens=1000)
    assert (fb.prefill, fb.decode, fb.route, fb.predicted_ttft_s) == (None, "d0", "direct", SPEED.ttft(1000, 0))
    # A producer with a queue never helps an idle decoder.
    s = snap(view("d0", queued=500), view("p0", decodes=False, prefills=True, queued=5000))
    assert plan_fallback(Q, s, R, prompt_tokens=1000).prefill is None


def test_split_always_takes_the_fastest_pair_over_an_idle_decoder():
    always = replace(R, split="always")
    s = snap(
        view("d0"),
        view("d1", queued=5000),
        view("p0", decodes=False, prefills=True),
        view("p1", decodes=False, prefills=True, queued=2000),
    )
    assert plan_fallback(Q, s, R, 1000).prefill is None  # the model: d0 computes it sooner
    fb = plan_fallback(Q, s, always, 1000)
    assert (fb.prefill, fb.decode) == ("p0", "d0")
    assert fb.decode_threshold == always.decode_guard_threshold
    # Below the floor nothing is split.
    assert plan_fallback(RouteQuery("m", "hi", prompt_tokens=10), s, always, 10).prefill is None


def test_fallback_floor_and_missing_producers():
    s = snap(view("d0", queued=50_000), view("p0", decodes=False, prefills=True))
    short = plan_fallback(Q, s, R, prompt_tokens=R.min_pd_prompt_tokens - 1)
    assert (short.prefill, short.decode, short.decode_threshold, short.route) == (None, "d0", 0.0, "direct")
    assert plan_fallback(Q, snap(view("d0", queued=50_000)), R, prompt_tokens=10_000).prefill is None


def test_fallback_never_pairs_a_backend_with_itself():
    s = snap(view("both", prefills=True, queued=50_000))
    assert plan_fallback(Q, s, R, prompt_tokens=10_000).prefill is None


def test_fallback_excludes_failed_backends():
    s = snap(view("d0"), view("d1", queued=5000), view("p0", decodes=False, prefills=True))
    fb = plan_fallback(Q, s, R, prompt_tokens=10_000, exclude=frozenset({"d0", "p0"}))
    assert (fb.decode, fb.prefill) == ("d1", None)
    assert plan_fallback(Q, s, R, 10, exclude=frozenset({"d0", "d1"})) is None


def test_fallback_decoder_weighs_the_partial_hit_against_the_queue():
    d = (view("d0"), view("d1", queued=300), view("d2", queued=3000))
    assert plan_fallback(Q, snap(*d), R, 2000).decode == "d0"
    # d1 lacks 2,000 - 1,200 = 800 tokens behind 300 queued: 1,100 < d0's 2,000.
    assert plan_fallback(Q, snap(*d), R, 2000, hits={"d1": 1200}).decode == "d1"
    # A smaller hit does not pay for the queue: 300 + 1,800 > 2,000.
    assert plan_fallback(Q, snap(*d), R, 2000, hits={"d1": 200}).decode == "d0"
    # Unknown length: estimated from the query (its exact token count here).
    assert plan_fallback(Q, snap(*d), R, None, hits={"d2": 1000}).decode == "d0"


@given(
    st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 4000)), min_size=1, max_size=5),
    st.lists(st.integers(0, 20_000), max_size=2),
    st.integers(1, 8000),
)
def test_fallback_is_the_least_predicted_time_of_every_option(decoders, producers, prompt):
    d = [view(f"d{i}", queued=q) for i, (q, _) in enumerate(decoders)]
    p = [view(f"p{i}", decodes=False, prefills=True, queued=q) for i, q in enumerate(producers)]
    hits = {f"d{i}": min(h, prompt) for i, (_, h) in enumerate(decoders) if h}
    s = snap(*d, *p)
    fb = plan_fallback(Q, s, R, prompt, hits=hits)
    options = [ttft(b.speed, b.queued_tokens, 0, prompt - hits.get(b.name, 0)) for b in d]
    options += [
        pd_ttft(x.speed, x.queued_tokens, 0, prompt, b.speed, b.queued_tokens, 0, s.transfer, prompt)
        for x in p
        for b in d
        if prompt >= R.min_pd_prompt_tokens and prompt - hits.get(b.name, 0) >= R.min_pd_prompt_tokens
    ]
    assert abs(fb.predicted_ttft_s - min(options)) < 1e-12
    assert (fb.prefill is not None) == (fb.predicted_ttft_s < min(options[: len(d)]))


def test_probe_strategy_expects_hits_where_it_sent_a_prefix():
    s = ProbeStrategy(R)
    leader = RouteQuery(model="m", text="system prompt " * 40 + "question one")
    s.on_routed(leader, "d1")
    follower = RouteQuery(model="m", text="system prompt " * 40 + "another question")
    hits = s.expected_hits(follower, 1000)
    # The shared head is ~560 of ~576 characters: most of the 1,000 tokens, expected on d1.
    assert set(hits) == {"d1"}
    assert 850 <= hits["d1"] < 1000
    assert s.expected_hits(RouteQuery(model="m", text="unrelated " * 60), 1000) == {}
    # Only where it was sent recently (it may still be computing it): by the send time.
    mem = PrefixMemory()
    mem.insert(mem.chunk_hashes(leader.text), "d0", now=100.0)
    mem.insert(mem.chunk_hashes(leader.text), "d1", now=130.0)
    assert set(mem.expected_hits(follower.text, 1000, sent_within_s=10.0, now=135.0)) == {"d1"}
    assert set(mem.expected_hits(follower.text, 1000, now=135.0)) == {"d0", "d1"}
    assert RoundRobinStrategy(R).expected_hits(follower, 1000) == {}


def test_max_probes_ranks_by_the_predicted_time_as_an_acceptor():
    strategy = ProbeStrategy(R, ProbeSettings(max_probes=2))
    decoders = (view("d0", queued=300), view("d1", queued=100), view("d2", queued=450), view("d3"))
    # Nothing known of the prompt: the two that would answer soonest.
    assert strategy.plan(Q, snap(*decoders)).probes == ("d3", "d1")
    # The router sent this prompt to d2: as an acceptor it lacks nothing (450 + 0 tokens),
    # so it is ranked first, then the next soonest acceptor.
    strategy.on_routed(Q, "d2")
    assert strategy.plan(Q, snap(*decoders)).probes == ("d2", "d3")
    other = RouteQuery(model="m", text="something else entirely " * 30, prompt_tokens=1000)
    assert strategy.plan(other, snap(*decoders)).probes == ("d3", "d1")
    # No bound, or a bound at least the fleet's size: every qualifying decoder, in order.
    assert ProbeStrategy(R).plan(Q, snap(*decoders)).probes == ("d0", "d1", "d2", "d3")
    assert ProbeStrategy(R, ProbeSettings(max_probes=4)).plan(Q, snap(*decoders)).probes == ("d0", "d1", "d2", "d3")


def test_a_drained_backend_is_never_planned_even_as_panic_routing():
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


def test_a_cpu_tier_hit_costs_more_than_a_gpu_hit_and_less_than_a_recompute():
    # Both engines hold 800 of the 1,000 tokens; "tiered" loads them from host memory at
    # 5 us per token (a twentieth of recomputing them), "gpu" has them in its prefix cache.
    tiered = view("tiered", speed=replace(SPEED, held_per_token_s=5e-6))
    gpu = view("gpu")
    cold = view("cold")
    hits = {"tiered": 800.0, "gpu": 800.0}
    assert predicted_ttft(tiered, 200, 1000) == ttft(SPEED, 0, 0, 200) + 800 * 5e-6
    assert predicted_ttft(gpu, 200, 1000) == ttft(SPEED, 0, 0, 200)
    for salt in range(4):
        q = RouteQuery("m", Q.text, salt=salt, prompt_tokens=1000)
        assert plan_fallback(q, snap(tiered, gpu, cold), R, 1000, hits=hits).decode == "gpu"
        # Without the GPU copy, the CPU copy still beats computing the prompt.
        assert plan_fallback(q, snap(tiered, cold), R, 1000, hits={"tiered": 800.0}).decode == "tiered"
    # A measured load cost above the recompute cost never makes a hit worse than a miss.
    slow = replace(SPEED, held_per_token_s=1.0)
    assert ttft(slow, 0, 0, 200, 800) == ttft(SPEED, 0, 0, 1000)


def test_probe_races_prompts_its_memory_does_not_place_where_those_races_pay():
    # Races over placed prompts saved nothing, races over unplaced ones (other replicas'
    # traffic) half the prefill: a prompt the memory knows goes straight to its holder,
    # one it does not know is raced.
    s = ClusterSnapshot(
        (view("d0"), view("d1")),
        transfer=TransferSpeed(0.005, 1e-5),
        chars_per_token=4.0,
        race_wait_s=0.01,
        race_saving_share=0.0,
        race_saving_share_unplaced=0.5,
    )
    probe = ProbeStrategy(R)
    unknown = RouteQuery("m", "never seen " * 100, salt=1, prompt_tokens=1000)
    plan = probe.plan(unknown, s)
    assert plan.probes == ("d0", "d1")
    assert plan.placed is False
    known = RouteQuery("m", Q.text, salt=1, prompt_tokens=1000)
    probe.on_routed(known, "d1")
    plan = probe.plan(known, s)
    assert plan.skipped_race
    assert plan.placed
    assert plan.direct == "d1"
