"""What a leg's ticket means for its engine (router/fleet/legs.py), through the registry that
keeps the tickets: decode-step samples, the decoding legs a stalling prefill has run beside,
splits awaiting their KV."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from router.config.schema import BackendConfig, HealthConfig
from router.fleet.legs import last_step_share
from router.fleet.registry import BackendRegistry
from router.routing.costmodel import EngineSpeed
from router.routing.goodput import Slo
from router.routing.speed_learner import OWN_FIT_SAMPLES, SpeedLearner
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


def test_an_engines_own_prefill_chunk_bounds_its_stalls_and_shows_in_its_view() -> None:
    # The fleet's chunk is 8,192 tokens; d1's engine runs 512 (vLLM --max-num-batched-tokens):
    # a 5,000-token prefill there adds 51 ms to a step, not 500 ms, and stalls nobody.
    r = BackendRegistry(
        [
            BackendConfig("d0", "http://d0", prefill_tokens_per_s=10_000.0),
            BackendConfig("d1", "http://d1", prefill_tokens_per_s=10_000.0, prefill_chunk_tokens=512),
        ],
        HealthConfig(),
        clock=lambda: 0.0,
    )
    r.slo = Slo(ttft_s=1.0, itl_s=0.1, chunk_tokens=8192)
    assert (registry_view(r, "d0").chunk_tokens, registry_view(r, "d1").chunk_tokens) == (8192, 512)
    assert r.open_leg("d0", 5000).stalls
    assert not r.open_leg("d1", 5000).stalls


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


def test_a_leg_whose_hits_were_known_when_sent_teaches_at_its_first_token_and_only_then() -> None:
    now = [0.0]
    r = _registry(lambda: now[0])
    leg = r.open_leg("d0", 5000, known_hits=(5000, 0))
    now[0] = 1.7
    r.first_token(leg)
    assert r.learner._engines["d0"].samples == 1  # seconds before the leg's usage arrives
    assert r.learner.speed("d0").per_token_s > r.learner.prior.per_token_s
    now[0] = 4.0
    assert r.learn_first_token(leg, 5000) == pytest.approx(1.7)
    assert r.learner._engines["d0"].samples == 1  # not twice
    # Hits not known: the sample waits for the usage at the leg's end, as before.
    other = r.open_leg("d0", 3000)
    now[0] = 5.0
    r.first_token(other)
    assert r.learner._engines["d0"].samples == 1
    r.learn_first_token(other, 3000)
    assert r.learner._engines["d0"].samples == 2


def test_a_prompts_last_step_is_shared_with_the_prompts_sent_while_its_earlier_chunks_ran() -> None:
    behind = ((0.2, 400), (0.9, 300))
    assert last_step_share(300, 1.0, behind, 512) == 0  # one step, its own
    # 600 tokens in 1.0 s: its last step began after 512 / 600 of it (0.85 s) with its own
    # tokens alone, after 512 / 1,000 (0.51 s) with the 400 sent at 0.2 s: both rounds agree.
    assert last_step_share(600, 1.0, behind, 512) == 400
    assert last_step_share(600, 1.0, ((0.1, 300), (0.3, 100), (0.7, 300)), 512) == (424 + 400) // 2
    assert last_step_share(1024, 1.0, behind, 512) == 0  # two full steps: no room
    assert last_step_share(600, 1.0, (), 512) == 0


def test_a_speed_sample_counts_what_prompts_sent_behind_it_added_to_its_last_step() -> None:
    now = [0.0]
    r = _registry(lambda: now[0])
    r.slo = Slo(chunk_tokens=512)
    leg = r.open_leg("d0", 100)  # the router guessed 100 tokens; its usage will say 600
    now[0] = 0.2
    r.open_leg("d0", 400)
    now[0] = 0.9
    r.open_leg("d0", 300)
    now[0] = 1.0
    r.first_token(leg)
    now[0] = 1.5
    r.open_leg("d0", 200)  # after its first token: not behind it
    assert leg.behind == ((0.2, 400), (0.9, 300))
    r.learn_first_token(leg, 600)
    expected = SpeedLearner()
    expected.observe_first_token("d0", 600 + 400, 0.0, 1.0)
    assert r.learner.speed("d0") == expected.speed("d0")
    # A leg queued behind another teaches nothing, so nothing is kept for it.
    queued = r.open_leg("d0", 500)
    r.first_token(queued)
    assert queued.behind == ()


def _measured(r: BackendRegistry, name: str) -> EngineSpeed:
    """`name`'s speed, measured on it: first tokens of clean legs at 10,000 tokens/s."""
    for i in range(OWN_FIT_SAMPLES):
        n = 200 + 100 * i
        r.learner.observe_first_token(name, n, 0.0, 0.02 + n * 1e-4)
    speed = r.learner.speed(name)
    assert speed.samples >= OWN_FIT_SAMPLES
    return speed


def test_a_prompt_in_its_prefill_counts_only_what_the_engine_has_left_of_it() -> None:
    now = [0.0]
    r = _registry(lambda: now[0])
    first = r.open_leg("d0", 2000)
    second = r.open_leg("d0", 1000)
    now[0] = 0.1
    # The prior's speed is a guess: a queue is not drained at it.
    assert registry_view(r, "d0").queued_tokens == 3000.0
    speed = _measured(r, "d0")
    a, b = speed.intercept_s, speed.per_token_s
    now[0] = a + 1500 * b  # 1,500 tokens prefilled since the first was sent to the empty queue
    assert registry_view(r, "d0").queued_tokens == pytest.approx(1500.0)
    probe = r.open_leg("d0", 0)
    # The model's input is what is left; whether it teaches the speed, what was sent.
    assert probe.queued_ahead == pytest.approx(1500.0)
    assert (probe.queued_whole, probe.nothing_ahead) == (3000.0, False)
    r.close_leg(probe)
    now[0] = a + 4000 * b  # past both at the measured speed, no first token yet: nothing left
    assert registry_view(r, "d0").queued_tokens == 0.0
    r.first_token(first)  # the engine is on the second from its first token on
    now[0] += a + 400 * b
    assert registry_view(r, "d0").queued_tokens == pytest.approx(600.0)
    r.first_token(second)
    assert registry_view(r, "d0").queued_tokens == 0.0
    assert r.open_leg("d0", 100).nothing_ahead


def test_other_replicas_waiting_prompts_keep_this_routers_legs_counted_whole() -> None:
    now = [0.0]
    r = _registry(lambda: now[0])
    r.learner.mean_prompt_tokens = 1000
    speed = _measured(r, "d0")
    a, b = speed.intercept_s, speed.per_token_s
    leg = r.open_leg("d0", 500)
    r.record_scrape("d0", {"vllm:num_requests_waiting": 3.0, "vllm:num_requests_running": 0.0}, None)
    # Two waiting beyond this router's own leg: 2,000 tokens ahead of it, drained at the
    # measured speed since the scrape; the leg behind them has not begun.
    now[0] = 1000 * b
    assert registry_view(r, "d0").queued_tokens == pytest.approx(1000.0 + 500.0)
    now[0] = 2000 * b + a + 300 * b  # through them, then 300 tokens of the leg
    assert registry_view(r, "d0").queued_tokens == pytest.approx(200.0)
    r.first_token(leg)


def test_prefilling_since_is_when_the_oldest_leg_without_a_first_token_was_sent() -> None:
    now = [1.0]
    r = _registry(lambda: now[0])
    assert registry_view(r, "d0").prefilling_since == float("inf")
    first = r.open_leg("d0", 100)
    now[0] = 2.0
    second = r.open_leg("d0", 100)
    now[0] = 3.0
    third = r.open_leg("d0", 100)
    assert registry_view(r, "d0").prefilling_since == 1.0
    r.first_token(second)  # answered out of order: the oldest is still the first
    assert registry_view(r, "d0").prefilling_since == 1.0
    r.close_leg(first)  # ended without a first token (a rejected probe)
    assert registry_view(r, "d0").prefilling_since == 3.0
    r.first_token(third)
    r.close_leg(third)
    r.close_leg(second)
    assert registry_view(r, "d0").prefilling_since == float("inf")
    assert r.states["d0"].legs.unanswered == {}
