"""What a leg's ticket means for its engine (router/fleet/legs.py), through the registry that
keeps the tickets: decode-step samples, the decoding legs a stalling prefill has run beside,
splits awaiting their KV."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from router.config.schema import BackendConfig, HealthConfig
from router.fleet.registry import BackendRegistry
from router.routing.goodput import Slo
from support.snapshots import registry_view


def _registry(clock: Callable[[], float]) -> BackendRegistry:
    return BackendRegistry([BackendConfig("d0", "http://d0")], HealthConfig(), clock=clock)


def test_an_ended_legs_gaps_teach_the_decode_step_less_the_prefills_computed_meanwhile() -> None:
    now = [0.0]
    r = _registry(lambda: now[0])
    other = r.open_leg("d0", 0)
    r.first_token(other)
    leg = r.open_leg("d0", 100)
    now[0] = 0.1
    r.first_token(leg)
    # While it decodes, another leg's 1,000 prompt tokens are prefilled there.
    late = r.open_leg("d0", 1000)
    r.first_token(late)
    now[0] = 1.1
    r.learn_decode(leg, 51)  # 50 gaps in 1.0 s
    b = r.learner.speed("d0").per_token_s
    fit = r.learner._steps["d0"]
    assert fit.samples == 1
    # One sample moves the fit towards (1.0 - b * 1000) / 50 at about (2 + 3 + 1) / 2 sequences.
    assert fit.predict((1.0, 3.0)) > r.learner.prior.step_s
    assert (1.0 - b * 1000) / 50 > r.learner.prior.step_s
    r.learn_decode(r.open_leg("d0", 10), 5)  # no first token: nothing learned
    assert fit.samples == 1


def test_a_stalling_prefill_counts_the_legs_decoding_beside_it_as_past_the_itl_slo() -> None:
    now = [0.0]
    r = BackendRegistry(
        [BackendConfig("d0", "http://d0", prefill_tokens_per_s=10_000.0)], HealthConfig(), clock=lambda: now[0]
    )
    r.slo = Slo(ttft_s=1.0, itl_s=0.1, chunk_tokens=8192)  # 1,000 tokens: 100 ms more per step
    early = r.open_leg("d0", 100)
    r.first_token(early)
    assert (early.stalls, registry_view(r, "d0").stalled) == (False, 0)
    long = r.open_leg("d0", 5000)
    assert (long.stalls, registry_view(r, "d0").stalled) == (True, 1)  # early decodes beside it from now on
    beside = r.open_leg("d0", 100)
    r.first_token(beside)  # starts decoding while the long prefill is not through
    r.first_token(long)  # through: it stalls nobody from now on, itself included
    assert (registry_view(r, "d0").decoding, registry_view(r, "d0").stalled) == (3, 2)
    after = r.open_leg("d0", 100)
    r.first_token(after)
    r.close_leg(early)
    assert (registry_view(r, "d0").decoding, registry_view(r, "d0").stalled) == (3, 1)
    r.close_leg(long)
    r.close_leg(beside)
    assert (registry_view(r, "d0").decoding, registry_view(r, "d0").stalled) == (1, 0)
    r.slo = None  # no SLO: no prefill is judged stalling
    assert not r.open_leg("d0", 5000).stalls


def test_a_split_s_place_on_its_decoder_counts_down_its_slo_until_the_decode_leg_takes_it() -> None:
    now = [10.0]
    r = _registry(lambda: now[0])
    place = r.open_leg("d0", kv_wait_s=0.8)
    now[0] = 10.3
    assert registry_view(r, "d0").kv_awaited_s == pytest.approx((0.5,))
    r.close_leg(place)  # the decode leg is sent: it is in the engine's queue now
    assert registry_view(r, "d0").kv_awaited_s == ()
    assert r.open_leg("d0", 100).kv_deadline is None


def test_only_a_leg_with_nothing_queued_ahead_teaches_the_engines_speed() -> None:
    now = [0.0]
    r = _registry(lambda: now[0])
    first = r.open_leg("d0", 5000)
    now[0] = 1.5
    second = r.open_leg("d0", 3000)  # 5,000 tokens ahead, most of them computed by now
    now[0] = 1.7
    r.first_token(first)
    now[0] = 2.7
    r.first_token(second)
    assert r.learn_first_token(second, 3000) == pytest.approx(1.2)
    # 8,000 tokens in 1.2 s would read as 150 us a token: not a sample.
    assert r.learner._engines.get("d0") is None
    assert r.learn_first_token(first, 5000) == pytest.approx(1.7)
    assert r.learner._engines["d0"].samples == 1
    # 5,000 tokens in 1.7 s: the fit moves from the 100 us prior towards 340 us.
    assert r.learner.speed("d0").per_token_s > r.learner.prior.per_token_s
