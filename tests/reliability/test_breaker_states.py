"""The circuit breaker's state machine with a fake clock (the HTTP-level behaviour is in
test_health.py): health checks never close it, a trial without a verdict frees the slot,
a silent trial expires, an unhealthy backend gets no trial."""

from router.config.schema import BackendConfig, HealthConfig
from router.fleet.registry import BackendRegistry
from router.names import BreakerState
from support.snapshots import registry_view


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _breaker(r: BackendRegistry, name: str) -> BreakerState:
    # Read through a call: mypy would keep an earlier assert's narrowing of the attribute.
    return r.states[name].breaker


def _registry(clock: Clock, threshold: int = 2, cooldown: float = 5.0) -> BackendRegistry:
    r = BackendRegistry(
        [BackendConfig("a", "http://a"), BackendConfig("b", "http://b")],
        HealthConfig(failure_threshold=threshold, cooldown_s=cooldown),
        clock=clock,
    )
    for n in ("a", "b"):
        r.record_scrape(n, {}, None)
    return r


def _open(r: BackendRegistry) -> None:
    r.record_failure("a", "500")
    r.record_failure("a", "500")
    assert _breaker(r, "a") == BreakerState.OPEN


def test_a_good_health_check_does_not_close_an_open_breaker() -> None:
    clock = Clock()
    r = _registry(clock)
    _open(r)
    r.record_scrape("a", {}, None)
    assert _breaker(r, "a") == BreakerState.OPEN
    assert not registry_view(r, "a").available
    assert [b.name for b in r.snapshot().decoders(None)] == ["b"]  # not even probed


def test_health_check_failures_do_not_open_the_breaker() -> None:
    r = _registry(Clock(), threshold=2)
    for _ in range(5):
        r.record_scrape_failure("a", "timeout", definitive=False)
    assert _breaker(r, "a") == BreakerState.CLOSED
    assert not r.states["a"].healthy
    r.record_scrape("a", {}, None)
    assert registry_view(r, "a").available


def test_a_trial_without_verdict_frees_the_slot() -> None:
    clock = Clock()
    r = _registry(clock)
    _open(r)
    clock.t += 5.0
    r.acquire("a")  # the trial (a probe)
    assert _breaker(r, "a") == BreakerState.HALF_OPEN
    assert not registry_view(r, "a").available
    r.release("a")  # rejected or lost the race: no verdict
    assert registry_view(r, "a").available
    r.acquire("a")
    r.release("a")
    r.record_success("a")
    assert _breaker(r, "a") == BreakerState.CLOSED


def test_a_silent_trial_expires_after_the_cooldown() -> None:
    clock = Clock()
    r = _registry(clock)
    _open(r)
    clock.t += 5.0
    r.acquire("a")  # a trial that never ends (stuck stream)
    clock.t += 4.9
    assert not registry_view(r, "a").available
    clock.t += 0.2
    assert registry_view(r, "a").available


def test_a_failed_trial_reopens_for_a_full_cooldown() -> None:
    clock = Clock()
    r = _registry(clock)
    _open(r)
    clock.t += 5.0
    r.acquire("a")
    r.release("a")
    r.record_failure("a", "still 500")
    assert _breaker(r, "a") == BreakerState.OPEN
    assert not registry_view(r, "a").available
    clock.t += 4.9
    assert not registry_view(r, "a").available
    clock.t += 0.2
    assert registry_view(r, "a").available


def test_an_unhealthy_open_backend_gets_no_trial() -> None:
    clock = Clock()
    r = _registry(clock)
    _open(r)
    r.record_scrape_failure("a", "refused")
    clock.t += 60
    assert not registry_view(r, "a").available
    r.record_scrape("a", {}, None)
    assert registry_view(r, "a").available
    assert _breaker(r, "a") == BreakerState.OPEN
