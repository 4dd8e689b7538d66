"""The policies that read the KV-event index, as pure functions of (query, snapshot):
`kv_events` routes by what the index says each engine holds; `probe` asks only the engines
the index cannot speak for, and says why it raced or not.

Every engine has one known speed (10 ms a step, 100 us a prompt token), so each expected
choice can be worked out by hand from the cost model."""

from __future__ import annotations

from dataclasses import replace

from router.config.schema import RoutingConfig
from router.names import Mode, RaceReason
from router.routing.costmodel import EngineSpeed, TransferSpeed
from router.routing.planning import RouteQuery
from router.routing.policies.kv_events import KvEventsStrategy
from router.routing.policies.probe import ProbeSettings, ProbeStrategy
from router.routing.snapshot import BackendView, ClusterSnapshot

SPEED = EngineSpeed(intercept_s=0.01, per_token_s=1e-4, per_decode_s=1e-3)
R = RoutingConfig()
Q = RouteQuery(model="m", text="shared system prompt " * 200, prompt_tokens=2000)


def view(name: str, *, fresh: bool = True, queued: float = 0.0) -> BackendView:
    return BackendView(
        name=name,
        url=f"http://{name}",
        decodes=True,
        prefills=False,
        models=("m",),
        available=True,
        inflight=0,
        running=0.0,
        waiting=0.0,
        kv_usage=0.0,
        queued_tokens=queued,
        speed=SPEED,
        kv_events_fresh=fresh,
    )


def snap(*views: BackendView) -> ClusterSnapshot:
    # Races have paid half a prompt's prefill, verdicts cost 2 ms: racing is worth it.
    return ClusterSnapshot(
        tuple(views),
        transfer=TransferSpeed(0.005, 1e-5),
        chars_per_token=4.0,
        race_wait_s=0.002,
        race_saving_share=0.5,
        race_saving_share_unplaced=0.5,
    )


def test_kv_events_sends_the_prompt_to_the_engine_the_index_says_holds_it() -> None:
    s = snap(view("d0"), view("d1"), view("d2"))
    plan = KvEventsStrategy(R).plan(replace(Q, indexed={"d0": 0.0, "d1": 1984.0, "d2": 0.0}), s)
    assert plan.direct == "d1"
    assert plan.prefill_tokens == 16  # 2,000 - 1,984 held
    assert plan.race_reason == RaceReason.NOT_RACING
    assert not plan.probes


def test_kv_events_weighs_the_hit_against_the_holders_queue() -> None:
    # d1 holds 1,000 tokens but has 3,000 queued: 0.01 + (3,000 + 1,000) x 1e-4 = 0.41 s,
    # against d0's 0.01 + 2,000 x 1e-4 = 0.21 s for the whole prompt.
    s = snap(view("d0"), view("d1", queued=3000.0))
    assert KvEventsStrategy(R).plan(replace(Q, indexed={"d0": 0.0, "d1": 1000.0}), s).direct == "d0"


def test_kv_events_without_the_index_is_cache_blind() -> None:
    s = snap(view("d0", queued=500.0), view("d1"))
    assert KvEventsStrategy(R).plan(Q, s).direct == "d1"  # no index: the least loaded
    assert KvEventsStrategy(R).expected_hits(Q, 2000.0) == {}


def test_probe_does_not_race_when_the_index_speaks_for_every_engine() -> None:
    s = snap(view("d0"), view("d1"))
    plan = ProbeStrategy(R).plan(replace(Q, indexed={"d0": 0.0, "d1": 1984.0}), s)
    assert plan.direct == "d1"
    assert not plan.probes
    assert plan.skipped_race
    assert plan.race_reason == RaceReason.INDEX_KNOWS


def test_probe_races_only_the_engines_the_index_cannot_speak_for() -> None:
    # d2's stream is behind (not fresh, so absent from `indexed`): it may hold the prompt.
    s = snap(view("d0"), view("d1"), view("d2", fresh=False))
    plan = ProbeStrategy(R).plan(replace(Q, indexed={"d0": 0.0, "d1": 0.0}), s)
    assert plan.probes == ("d2",)
    assert plan.race_reason == RaceReason.RACED


def test_probe_asks_no_one_slower_than_a_known_holder() -> None:
    # d1 is known to hold all but 16 tokens (0.0116 s); d2, unknown, could at best hold
    # half as an acceptor at T = 0.5: 0.01 + 1,000 x 1e-4 = 0.11 s. Nothing to ask.
    s = snap(view("d0"), view("d1"), view("d2", fresh=False))
    plan = ProbeStrategy(R).plan(replace(Q, indexed={"d0": 0.0, "d1": 1984.0}), s)
    assert plan.direct == "d1"
    assert not plan.probes
    assert plan.race_reason == RaceReason.INDEX_KNOWS


def test_a_stream_that_stopped_costs_no_request_probe_asks_again() -> None:
    # No engine's index is fresh: the query carries nothing, and probe races as before.
    s = snap(view("d0", fresh=False), view("d1", fresh=False))
    plan = ProbeStrategy(R).plan(Q, s)
    assert set(plan.probes) == {"d0", "d1"}
    assert plan.race_reason == RaceReason.RACED


def test_race_always_asks_every_engine_whatever_the_index_says() -> None:
    s = snap(view("d0"), view("d1"))
    always = ProbeStrategy(R, ProbeSettings(race=Mode.ALWAYS))
    plan = always.plan(replace(Q, indexed={"d0": 0.0, "d1": 0.0}), s)
    assert set(plan.probes) == {"d0", "d1"}
    assert plan.race_reason == RaceReason.ALWAYS


def test_probe_expects_a_prompt_it_just_sent_where_the_index_has_no_event_yet() -> None:
    probe = ProbeStrategy(R)
    probe.on_routed(Q, "d0")  # d0 may still be computing it: no block stored, no event
    hits = probe.expected_hits(replace(Q, indexed={"d0": 0.0, "d1": 512.0}), 2000.0)
    assert hits["d0"] > 1000.0
    assert hits["d1"] == 512.0
    # Without the index the memory alone speaks, as before.
    assert set(probe.expected_hits(Q, 2000.0)) == {"d0"}


def _placed(at: float) -> ProbeStrategy:
    probe = ProbeStrategy(R)
    probe.memory.insert(probe.memory.chunk_hashes(Q.text), "d1", now=at)
    return probe


def test_probe_skips_the_index_lookup_where_its_memory_already_says_what_it_would() -> None:
    # The router sent the prompt to d1 at t = 100; d1's stream is fresh and lost nothing
    # since: d1 still holds it, and with no traffic from elsewhere nobody holds more.
    fresh = snap(view("d0"), replace(view("d1"), kv_removed_at=50.0))
    probe = _placed(100.0)
    assert not probe.wants_index(Q, fresh)
    # Nor does it race there: the engines cannot say more than the memory does.
    plan = probe.plan(Q, fresh)
    assert plan.direct == "d1"
    assert not plan.probes
    assert plan.race_reason == RaceReason.MEMORY_KNOWS


def test_probe_asks_the_index_where_its_memory_may_be_wrong_or_incomplete() -> None:
    probe = _placed(100.0)
    # d1 lost blocks after the router placed the prompt there: evicted, maybe this one.
    assert probe.wants_index(Q, snap(view("d0"), replace(view("d1"), kv_removed_at=150.0)))
    # d1's stream is behind: its removals may not have arrived.
    assert probe.wants_index(Q, snap(view("d0"), view("d1", fresh=False)))
    # Another router sends d0 traffic: d0 may hold the prompt through it.
    shared = snap(replace(view("d0"), others_seen=True), replace(view("d1"), kv_removed_at=50.0))
    assert probe.wants_index(Q, shared)
    # A prompt the memory places nowhere: only the engines' events can say.
    assert ProbeStrategy(R).wants_index(Q, snap(view("d0"), view("d1")))
