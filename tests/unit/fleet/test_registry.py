"""Backend registry (router/fleet/registry.py): circuit breaker, health, in-flight counts,
scraped load, leg tickets' token-level load, snapshots."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from router.config.schema import BackendConfig, HealthConfig
from router.fleet.registry import BackendRegistry
from router.names import BreakerState, Role
from router.routing.snapshot import BackendView


def _view(r: BackendRegistry, name: str) -> BackendView:
    view = r.snapshot().get(name)
    assert view is not None  # a configured backend
    return view


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
    view = _view(r, "d0")
    assert (view.queued_tokens, view.decoding, view.inflight) == (1300, 0, 2)
    assert (b.queued_ahead, b.decoding) == (1000, 0)  # what was ahead of b when it was sent
    now[0] = 100.25
    r.first_token(a)
    r.first_token(a)  # repeated: no double count
    view = _view(r, "d0")
    assert (view.queued_tokens, view.decoding) == (300, 1)
    r.close_leg(a)
    r.close_leg(a)
    r.close_leg(b)  # closed before its first token (cancelled): its tokens leave the queue
    r.first_token(b)  # too late: ignored
    view = _view(r, "d0")
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
    view = _view(r, "d0")
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
    view = _view(r, "d0")
    assert (view.queued_tokens, view.decoding) == (0.0, 0.0)
    # Two prompts of another replica waiting at the scrape: 2,000 tokens, drained at the
    # prior's 10,000 tokens/s.
    r.record_scrape("d0", {"vllm:num_requests_waiting": 2.0, "vllm:num_requests_running": 1.0}, None)
    assert _view(r, "d0").queued_tokens == 2000.0
    now[0] = 0.1
    assert _view(r, "d0").queued_tokens == pytest.approx(1000.0)
    now[0] = 0.5
    assert _view(r, "d0").queued_tokens == 0.0
    assert _view(r, "d0").decoding == 1.0


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
    assert _view(r, "a").available
    r.record_failure("a", "x")
    r.record_failure("a", "x")
    assert _breaker(r, "a") == BreakerState.CLOSED
    assert _view(r, "a").available
    r.record_failure("a", "x")
    assert _breaker(r, "a") == BreakerState.OPEN
    assert not _view(r, "a").available
    assert not r.ready()  # the only decoder is open
    clock.t += 5.0
    assert _view(r, "a").available  # cool-down over: one trial allowed
    r.acquire("a")
    assert _breaker(r, "a") == BreakerState.HALF_OPEN
    assert not _view(r, "a").available
    r.release("a")
    r.record_failure("a", "still broken")
    assert _breaker(r, "a") == BreakerState.OPEN
    clock.t += 5.0
    r.acquire("a")
    r.release("a")
    r.record_success("a")
    assert _breaker(r, "a") == BreakerState.CLOSED
    assert _view(r, "a").available
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
    assert not _view(r, "a").available
    r.record_scrape("a", {"vllm:num_requests_waiting": 3.0}, None)
    v = _view(r, "a")
    assert v.available
    assert v.waiting == 3.0


def test_inflight_counts_and_load() -> None:
    r = registry(Clock())
    r.acquire("a")
    r.acquire("a")
    assert _view(r, "a").inflight == 2
    assert _view(r, "a").load == 2
    r.release("a")
    r.record_scrape("a", {"vllm:num_requests_running": 4.0, "vllm:num_requests_waiting": 1.0}, None)
    assert _view(r, "a").load == 5.0


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
