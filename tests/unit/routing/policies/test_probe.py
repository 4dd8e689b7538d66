"""The `probe` strategy (router/routing/policies/probe.py): which engines are probed, when a
race is worth it, and what the memory expects. Plain data in, a plan out; one known engine
speed so each expected choice can be worked out by hand from the cost model."""

from __future__ import annotations

from router.names import Mode
from router.routing.costmodel import TransferSpeed
from router.routing.planning import RouteQuery
from router.routing.policies.probe import EXPLORE_ONE_IN, ProbeSettings, ProbeStrategy
from router.routing.policies.round_robin import RoundRobinStrategy
from router.routing.prefix_memory import PrefixMemory
from router.routing.snapshot import ClusterSnapshot
from support.snapshots import SPEED, Q, R, snap, view


def test_probe_targets_every_available_decoder_for_the_model() -> None:
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


def test_probe_skips_long_queues_but_never_everything() -> None:
    routing = ProbeSettings(max_probe_waiting=4)
    s = snap(view("busy", waiting=10), view("idle", waiting=1))
    assert ProbeStrategy(R, routing).plan(Q, s).probes == ("idle",)
    s = snap(view("busy", waiting=10), view("busier", waiting=20))
    assert set(ProbeStrategy(R, routing).plan(Q, s).probes) == {"busy", "busier"}


def test_probe_skips_an_engine_that_even_as_an_acceptor_is_slower_than_computing_elsewhere() -> None:
    # d0 has 3,000 tokens queued: as an acceptor it would prefill 500 + 3,000 = 3,500 tokens,
    # while d1 computes the whole prompt (1,000) now. Waiting for d0 can only cost time.
    # (So even if the memory says d0 holds the prompt: 3,000 + 0 > 1,000.)
    s = snap(view("d0", queued=3000), view("d1"))
    assert ProbeStrategy(R).plan(Q, s).probes == ("d1",)
    # A smaller queue (400 + 500 < 1,000): d0 may still win as an acceptor, so it is asked.
    s = snap(view("d0", queued=400), view("d1"))
    assert ProbeStrategy(R).plan(Q, s).probes == ("d0", "d1")


def test_probe_goes_straight_to_the_cold_choice_when_no_hit_could_pay_for_the_race() -> None:
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


def test_probe_races_only_where_races_have_been_paying_off_but_keeps_exploring() -> None:
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


def test_probe_strategy_expects_hits_where_it_sent_a_prefix() -> None:
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


def test_max_probes_ranks_by_the_predicted_time_as_an_acceptor() -> None:
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


def test_probe_races_prompts_its_memory_does_not_place_where_those_races_pay() -> None:
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
