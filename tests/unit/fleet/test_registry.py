"""Backend registry (router/fleet/registry.py): circuit breaker, health, in-flight counts,
scraped load, leg tickets' token-level load, snapshots."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config.schema import BackendConfig, HealthConfig
from router.engine.scrape import KV_USAGE, RUNNING, WAITING
from router.fleet.registry import BackendRegistry, LegTicket
from router.names import BreakerState, Role
from router.routing.goodput import Slo
from router.routing.snapshot import BackendView
from support.snapshots import registry_view


def _breaker(r: BackendRegistry, name: str) -> BreakerState:
    # Read through a call: mypy would keep an earlier assert's narrowing of the attribute.
    return r.states[name].breaker


def _registry(clock: Callable[[], float]) -> BackendRegistry:
    return BackendRegistry([BackendConfig("d0", "http://d0")], HealthConfig(), clock=clock)


def test_leg_tickets_queue_tokens_until_the_first_token_then_count_a_decoding_sequence() -> None:
    now = [100.0]
    r = _registry(lambda: now[0])
    r.record_scrape("d0", {}, None)
    a = r.open_leg("d0", 1000)
    b = r.open_leg("d0", 300)
    view = registry_view(r, "d0")
    assert (view.queued_tokens, view.decoding, view.inflight) == (1300, 0, 2)
    assert (b.queued_ahead, b.decoding) == (1000, 0)  # what was ahead of b when it was sent
    now[0] = 100.25
    r.first_token(a)
    r.first_token(a)  # repeated: no double count
    view = registry_view(r, "d0")
    assert (view.queued_tokens, view.decoding) == (300, 1)
    # The 1,300 prompt tokens sent are the prompt work asked for lately (over 1 s at least).
    assert r.snapshot().prompt_tokens_per_s == pytest.approx(1300.0 * math.exp(-0.025))
    r.close_leg(a)
    r.close_leg(a)
    r.close_leg(b)  # closed before its first token (cancelled): its tokens leave the queue
    r.first_token(b)  # too late: ignored
    view = registry_view(r, "d0")
    assert (view.queued_tokens, view.decoding, view.inflight) == (0, 0, 0)
    # a's sample: 0 ahead + 800 lacking (200 cached), 0.25 s.
    assert r.learn_first_token(a, 800) == 0.25
    assert r.learner.speed("d0").samples == 1
    assert r.learn_first_token(b, 300) is None  # no first token: no sample


def test_scraped_waiting_beyond_our_own_legs_counts_as_other_replicas_traffic() -> None:
    r = _registry(lambda: 0.0)
    r.learner.mean_prompt_tokens = 2000
    r.open_leg("d0", 500)
    r.record_scrape("d0", {"vllm:num_requests_waiting": 3.0, "vllm:num_requests_running": 5.0}, None)
    view = registry_view(r, "d0")
    # Our one leg explains one waiting request; two more at the mean prompt length; the
    # five running are other replicas' too (our only leg is the waiting one).
    assert view.queued_tokens == 500 + 2 * 2000
    assert view.decoding == 5.0


def test_a_scrape_is_a_moment_of_the_past() -> None:
    """A scrape that caught this router's own burst counts none of it as other replicas'
    traffic once the burst is gone, and other replicas' waiting prompts drain at the
    engine's measured speed after the scrape."""
    now = [0.0]
    r = _registry(lambda: now[0])
    r.learner.mean_prompt_tokens = 1000
    tickets = [r.open_leg("d0", 1000) for _ in range(4)]
    r.record_scrape("d0", {"vllm:num_requests_waiting": 4.0, "vllm:num_requests_running": 0.0}, None)
    for t in tickets:
        r.first_token(t)
        r.close_leg(t)
    view = registry_view(r, "d0")
    assert (view.queued_tokens, view.decoding) == (0.0, 0.0)
    # Two prompts of another replica waiting at the scrape: 2,000 tokens, drained at the
    # prior's 10,000 tokens/s.
    r.record_scrape("d0", {"vllm:num_requests_waiting": 2.0, "vllm:num_requests_running": 1.0}, None)
    assert registry_view(r, "d0").queued_tokens == 2000.0
    now[0] = 0.1
    assert registry_view(r, "d0").queued_tokens == pytest.approx(1000.0)
    now[0] = 0.5
    assert registry_view(r, "d0").queued_tokens == 0.0
    assert registry_view(r, "d0").decoding == 1.0


def test_legs_that_ended_while_a_scrape_was_read_are_not_other_replicas_sequences() -> None:
    r = _registry(lambda: 0.0)
    tickets = [r.open_leg("d0", 100) for _ in range(3)]
    for t in tickets:
        r.first_token(t)
    before = r.states["d0"].legs_closed
    # The engine answered /metrics with all three running; two ended before the answer came.
    r.close_leg(tickets[0])
    r.close_leg(tickets[1])
    r.record_scrape("d0", {RUNNING: 3.0, WAITING: 0.0}, None, legs_closed_before=before)
    others = r.states["d0"].others
    assert (others.running, others.seen(0.0)) == (0.0, False)
    assert registry_view(r, "d0").decoding == 1.0
    # Without the count at the read's start the two read as another replica's sequences.
    r.record_scrape("d0", {RUNNING: 3.0, WAITING: 0.0}, None)
    assert (r.states["d0"].others.running, r.states["d0"].others.seen(0.0)) == (2.0, True)


def test_a_backend_added_at_run_time_starts_from_its_own_configured_speed_and_removal_forgets_it() -> None:
    r = _registry(lambda: 0.0)
    r.add(BackendConfig("late", "http://late", prefill_tokens_per_s=2000.0))
    assert r.learner.speed("late").per_token_s == 1.0 / 2000.0  # not the fleet-wide prior
    r.set_draining("late", True)
    r.remove("late")
    r.add(BackendConfig("late", "http://elsewhere"))  # another machine under the same name
    assert r.learner.speed("late").per_token_s == r.learner.prior.per_token_s


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def registry(clock: Clock, threshold: int = 3, cooldown: float = 5.0) -> BackendRegistry:
    cfgs = [BackendConfig("a", "http://a"), BackendConfig("p", "http://p", role=Role.PREFILL)]
    r = BackendRegistry(cfgs, HealthConfig(failure_threshold=threshold, cooldown_s=cooldown), clock=clock)
    for n in ("a", "p"):
        r.record_scrape(n, {}, None)
    return r


def test_breaker_opens_after_consecutive_failures_and_recovers_through_half_open() -> None:
    clock = Clock()
    r = registry(clock)
    assert registry_view(r, "a").available
    r.record_failure("a", "x")
    r.record_failure("a", "x")
    assert _breaker(r, "a") == BreakerState.CLOSED
    assert registry_view(r, "a").available
    r.record_failure("a", "x")
    assert _breaker(r, "a") == BreakerState.OPEN
    assert not registry_view(r, "a").available
    assert not r.ready()  # the only decoder is open
    clock.t += 5.0
    assert registry_view(r, "a").available  # cool-down over: one trial allowed
    r.acquire("a")
    assert _breaker(r, "a") == BreakerState.HALF_OPEN
    assert not registry_view(r, "a").available
    r.release("a")
    r.record_failure("a", "still broken")
    assert _breaker(r, "a") == BreakerState.OPEN
    clock.t += 5.0
    r.acquire("a")
    r.release("a")
    r.record_success("a")
    assert _breaker(r, "a") == BreakerState.CLOSED
    assert registry_view(r, "a").available
    assert r.ready()


def test_success_resets_the_failure_count() -> None:
    r = registry(Clock())
    r.record_failure("a", "x")
    r.record_failure("a", "x")
    r.record_success("a")
    r.record_failure("a", "x")
    assert _breaker(r, "a") == BreakerState.CLOSED


def test_scrape_failure_marks_unhealthy_until_it_answers() -> None:
    r = registry(Clock(), threshold=100)
    r.record_scrape_failure("a", "refused")
    assert not registry_view(r, "a").available
    r.record_scrape("a", {"vllm:num_requests_waiting": 3.0}, None)
    v = registry_view(r, "a")
    assert v.available
    assert v.waiting == 3.0


def test_inflight_counts_and_load() -> None:
    r = registry(Clock())
    r.acquire("a")
    r.acquire("a")
    assert registry_view(r, "a").inflight == 2
    assert registry_view(r, "a").load == 2
    r.release("a")
    r.record_scrape("a", {"vllm:num_requests_running": 4.0, "vllm:num_requests_waiting": 1.0}, None)
    assert registry_view(r, "a").load == 5.0


def test_models_come_from_config_or_discovery() -> None:
    r = BackendRegistry(
        [BackendConfig("a", "http://a"), BackendConfig("b", "http://b", models=("m2",))], HealthConfig()
    )
    r.record_scrape("a", {}, ("m1",))
    r.record_scrape("b", {}, ("ignored",))
    assert r.models() == ["m1", "m2"]


def test_ambiguous_check_failures_need_the_threshold_definitive_ones_do_not() -> None:
    r = registry(Clock(), threshold=3)
    r.record_scrape_failure("a", "timeout", definitive=False)
    r.record_scrape_failure("a", "timeout", definitive=False)
    assert r.states["a"].healthy
    r.record_scrape("a", {}, None)  # an answer resets the count
    r.record_scrape_failure("a", "timeout", definitive=False)
    r.record_scrape_failure("a", "timeout", definitive=False)
    assert r.states["a"].healthy
    r.record_scrape_failure("a", "timeout", definitive=False)
    assert not r.states["a"].healthy
    r.record_scrape("a", {}, None)
    r.record_scrape_failure("a", "refused", definitive=True)
    assert not r.states["a"].healthy


def test_panic_routing_when_no_decoder_is_available() -> None:
    r = registry(Clock(), threshold=1)
    r.record_scrape_failure("a", "refused")
    snap = r.snapshot()
    a = snap.get("a")
    assert a is not None
    assert not a.available
    assert [b.name for b in snap.decoders(None)] == ["a"]  # nothing available: try them all
    assert snap.prefillers(None)[0].name == "p"  # prefill backends never panic: the fallback goes direct
    r.record_scrape_failure("p", "refused")
    assert r.snapshot().prefillers(None) == []


def test_adapters_listed_by_an_engine_make_the_snapshot_strict_about_them() -> None:
    reg = BackendRegistry(
        [BackendConfig("d0", "http://d0"), BackendConfig("d1", "http://d1")], HealthConfig(), clock=lambda: 0.0
    )
    reg.record_scrape("d0", {}, ("base", "sql"), ("sql",))
    snap = reg.snapshot()
    assert snap.adapters == frozenset({"sql"})
    assert snap.get("d0").adapters == ("sql",)  # type: ignore[union-attr]
    # d1 has not answered a check yet: it may serve the base model, never the adapter.
    assert [b.name for b in snap.backends if snap.serves(b, "sql")] == ["d0"]
    assert [b.name for b in snap.backends if snap.serves(b, "base")] == ["d0", "d1"]


def test_a_dp_ranks_requests_carry_its_rank_header() -> None:
    ranks = [BackendConfig(f"s-dp{r}", "http://s", data_parallel_size=2, data_parallel_rank=r) for r in (0, 1)]
    reg = BackendRegistry([*ranks, BackendConfig("plain", "http://p")], HealthConfig())
    assert reg.backend_headers == {"s-dp0": {"X-data-parallel-rank": "0"}, "s-dp1": {"X-data-parallel-rank": "1"}}
    reg.set_draining("s-dp1", True)
    reg.remove("s-dp1")
    assert list(reg.backend_headers) == ["s-dp0"]


def _views_by_keyword(r: BackendRegistry, now: float) -> tuple[BackendView, ...]:
    """Each backend's view as the snapshot describes it, built by keyword: what the
    snapshot's positional construction must equal."""
    removed = r.kv_index.last_removals() if r.kv_index is not None else {}
    return tuple(
        BackendView(
            name=s.config.name,
            url=s.config.url,
            decodes=s.config.decodes,
            prefills=s.config.prefills,
            models=s.models,
            available=r._available(s, now),
            inflight=s.inflight,
            running=s.running,
            waiting=s.waiting,
            kv_usage=s.kv_usage,
            drained=s.draining,
            queued_tokens=r._queued_tokens(s, now, r.learner.speed(s.config.name))[0],
            decoding=s.decoding + s.others.decoding(now),
            prefilling=s.prefilling,
            speed=r.learner.speed(s.config.name),
            threshold_capable=s.threshold_capable is not False,
            kv_events_fresh=r.kv_fresh is not None and r.kv_fresh(s, now),
            kv_removed_at=removed.get(s.config.name, 0.0),
            others_seen=s.others.seen(now),
            adapters=s.adapters,
            itl=r.learner.itl(s.config.name),
            stalled=s.decoding - s.legs.clean,
            kv_awaited_s=s.legs.kv_awaited_s(now),
            prefilling_since=s.legs.prefilling_since,
            chunk_tokens=r.chunk_of(s),
        )
        for s in r.states.values()
    )


def _stalled_by_history(tickets: list[LegTicket], events: list[tuple[str, LegTicket]], name: str) -> int:
    """The legs decoding on `name` that a stalling prefill ran beside, from the order of
    events: one was sent there and not through at the leg's first token, or sent after it."""
    stalled = 0
    for t in tickets:
        if t.backend != name or t.first_token_at is None or t.closed:
            continue
        at = events.index(("first_token", t))
        for i, (kind, other) in enumerate(events):
            if other is t or other.backend != name or not other.stalls or kind != "open":
                continue
            through = [j for j, (k, o) in enumerate(events) if o is other and k in ("first_token", "close")]
            if i > at or (i < at and (not through or through[0] > at)):
                stalled += 1
                break
    return stalled


_names = st.sampled_from(["d0", "d1", "p0"])
_operations = st.lists(
    st.one_of(
        st.tuples(st.just("open"), _names, st.integers(0, 5000)),
        st.tuples(st.just("first_token"), st.integers(0, 20), st.floats(0.001, 5.0)),
        st.tuples(st.just("close"), st.integers(0, 20)),
        st.tuples(
            st.just("scrape"),
            _names,
            st.fixed_dictionaries({RUNNING: st.floats(0, 50), WAITING: st.floats(0, 50), KV_USAGE: st.floats(0, 1)}),
        ),
        st.tuples(st.just("scrape_failed"), _names, st.booleans()),
        st.tuples(st.just("failure"), _names),
        st.tuples(st.just("success"), _names),
        st.tuples(st.just("drain"), _names, st.booleans()),
        st.tuples(st.just("adapters"), _names, st.lists(st.sampled_from(["lora-a", "lora-b"]), max_size=2)),
        st.tuples(st.just("learn"), st.integers(0, 20), st.integers(0, 64)),
        st.tuples(st.just("wait"), st.floats(0.0, 120.0)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=_operations)
def test_the_snapshot_is_every_backend_s_view_after_any_sequence_of_changes(ops: list[tuple[Any, ...]]) -> None:
    now = [1000.0]
    cfgs = [
        BackendConfig("d0", "http://d0"),
        BackendConfig("d1", "http://d1", prefill_tokens_per_s=5000.0),
        BackendConfig("p0", "http://p0", role=Role.PREFILL),
    ]
    r = BackendRegistry(cfgs, HealthConfig(failure_threshold=2, cooldown_s=5.0), clock=lambda: now[0])
    r.slo = Slo(ttft_s=1.0, itl_s=0.1, chunk_tokens=8192)  # d1: 500 tokens and more stall its steps
    tickets: list[LegTicket] = []
    events: list[tuple[str, LegTicket]] = []  # what each leg went through, in order
    for op in ops:
        kind, *args = op
        if kind == "open":
            tickets.append(r.open_leg(args[0], args[1]))
            events.append(("open", tickets[-1]))
        elif kind == "first_token" and tickets:
            t = tickets[args[0] % len(tickets)]
            if t.first_token_at is None and not t.closed:
                events.append(("first_token", t))
            r.first_token(t, t.sent_at + args[1])
        elif kind == "close" and tickets:
            t = tickets[args[0] % len(tickets)]
            if not t.closed:
                events.append(("close", t))
            r.close_leg(t)
        elif kind == "scrape":
            r.record_scrape(args[0], args[1], None)
        elif kind == "scrape_failed":
            r.record_scrape_failure(args[0], "down", definitive=args[1])
        elif kind == "failure":
            r.record_failure(args[0], "connect")
        elif kind == "success":
            r.record_success(args[0])
        elif kind == "drain":
            r.set_draining(args[0], args[1])
        elif kind == "adapters":
            r.states[args[0]].adapters = tuple(args[1])
        elif kind == "learn" and tickets:
            t = tickets[args[0] % len(tickets)]
            r.learn_first_token(t, t.tokens)
            r.learn_decode(t, args[1])
        elif kind == "wait":
            now[0] += args[0]
        snap = r.snapshot()
        assert snap.backends == _views_by_keyword(r, now[0])
        for b in snap.backends:
            assert b.stalled == _stalled_by_history(tickets, events, b.name)
        assert snap.adapters == frozenset(a for s in r.states.values() for a in s.adapters)
