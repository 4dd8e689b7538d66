"""Engines whose answers stall (router/fleet/stalls.py): marked slow, avoided, back later."""

from __future__ import annotations

from router.config.schema import BackendConfig, HealthConfig
from router.fleet.registry import BackendRegistry
from router.fleet.stalls import MAX_SLOW_S, MIN_SAMPLES, RESET_S, StallWatch, is_stalled


def test_late_beyond_the_prediction_is_a_stall_queueing_is_not() -> None:
    assert is_stalled(1.6, 0.05)
    assert not is_stalled(0.9, 0.05)  # under a second late: load
    assert not is_stalled(6.0, 2.0)  # a long prefill a little later than predicted


def test_two_stalls_within_the_window_mark_an_engine_slow_for_a_while() -> None:
    w = StallWatch(slow_s=5.0)
    w.first_token("e", 2.0, 0.05, now=100.0, samples=MIN_SAMPLES)
    assert not w.slow("e", 100.0)
    w.first_token("e", 2.0, 0.05, now=101.0, samples=MIN_SAMPLES)
    assert w.slow("e", 101.0)
    assert w.slow("e", 105.9)
    assert not w.slow("e", 106.1)  # it gets traffic again: its next answers are its trial
    assert not w.slow("other", 101.0)


def test_stalling_again_soon_doubles_the_time_up_to_the_cap_then_resets() -> None:
    w = StallWatch(slow_s=5.0)
    now, periods = 0.0, []
    for _ in range(6):
        w.first_token("e", 2.0, 0.05, now, samples=MIN_SAMPLES)
        w.first_token("e", 2.0, 0.05, now + 0.1, samples=MIN_SAMPLES)
        end = now + 0.1
        while w.slow("e", end):
            end += 0.5
        periods.append(round(end - now - 0.1))
        now = end
    assert periods == [5, 10, 20, 40, MAX_SLOW_S, MAX_SLOW_S]
    now += RESET_S + 1
    w.first_token("e", 2.0, 0.05, now, samples=MIN_SAMPLES)
    w.first_token("e", 2.0, 0.05, now, samples=MIN_SAMPLES)
    assert w.slow("e", now + 4.9)
    assert not w.slow("e", now + 5.1)


def test_a_health_check_far_slower_than_the_rounds_others_is_a_stall() -> None:
    w = StallWatch(slow_s=5.0)
    w.check_round({"a": 0.004, "b": 0.005, "c": 1.2}, now=10.0)
    w.check_round({"a": 0.004, "b": 0.005, "c": 0.9}, now=11.0)
    assert w.slow("c", 11.0)
    assert not w.slow("a", 11.0)


def test_a_slow_router_slows_the_whole_round_and_marks_nobody() -> None:
    w = StallWatch(slow_s=5.0)
    for t in range(5):
        w.check_round({"a": 0.8 + 0.1 * t, "b": 0.9, "c": 1.1}, now=float(t))
    w.check_round({"c": 3.0}, now=6.0)  # alone: nothing to compare with
    assert not any(w.slow(n, 6.0) for n in ("a", "b", "c"))


def test_an_engine_not_measured_yet_is_not_judged() -> None:
    w = StallWatch(slow_s=5.0)
    for t in range(5):
        w.first_token("e", 9.0, 0.05, now=float(t), samples=MIN_SAMPLES - 1)
        w.token_gap("e", 9.0, 0.05, now=float(t), samples=0)
    assert not w.slow("e", 5.0)


def test_zero_turns_it_off() -> None:
    w = StallWatch(slow_s=0.0)
    for t in range(5):
        w.first_token("e", 9.0, 0.05, now=float(t), samples=MIN_SAMPLES)
    assert not w.slow("e", 5.0)


def test_a_slow_engine_is_unavailable_and_forgotten_when_removed() -> None:
    clock = [0.0]
    registry = BackendRegistry(
        [BackendConfig(name=n, url=f"http://{n}:1", models=("m",)) for n in ("d0", "d1")],
        HealthConfig(),
        clock=lambda: clock[0],
    )
    for s in registry.states.values():
        s.healthy = True
    for _ in range(MIN_SAMPLES):  # measured first: prompt answered in 50 ms
        ticket = registry.open_leg("d0", 10)
        clock[0] += 0.05
        registry.first_token(ticket)
        registry.learn_first_token(ticket, 10)
        registry.close_leg(ticket)
    assert {v.name: v.available for v in registry.snapshot().backends} == {"d0": True, "d1": True}
    for _ in range(2):
        ticket = registry.open_leg("d0", 10)
        clock[0] += 3.0  # a first token three seconds late
        registry.first_token(ticket)
        registry.close_leg(ticket)
    views = {v.name: v.available for v in registry.snapshot().backends}
    assert views == {"d0": False, "d1": True}
    registry.set_draining("d0", True)
    registry.remove("d0")
    assert not registry.stalls.slow("d0", clock[0])


def test_long_gaps_between_tokens_are_stalls_a_slow_step_is_not() -> None:
    w = StallWatch(slow_s=5.0)
    w.token_gap("e", 0.9, 0.03, now=1.0, samples=MIN_SAMPLES)
    w.token_gap("e", 2.5, 1.0, now=2.0, samples=MIN_SAMPLES)  # a heavy batch: steps of a second
    assert not w.slow("e", 2.0)
    w.token_gap("e", 1.5, 0.03, now=3.0, samples=MIN_SAMPLES)
    w.token_gap("e", 1.4, 0.03, now=4.0, samples=MIN_SAMPLES)
    assert w.slow("e", 4.0)
