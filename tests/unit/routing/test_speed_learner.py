"""What the router learns online (router/routing/speed_learner.py): engine speeds fitted
from first tokens, characters per token, and what races are worth."""

from __future__ import annotations

import random

import pytest

from router.config.schema import RoutingConfig
from router.routing.speed_learner import SpeedLearner, SpeedPrior, speed_prior


def _engine(rng: random.Random, a: float, b: float, c: float, noise: float) -> tuple[float, float, float]:
    w, d = rng.uniform(0, 8000), rng.uniform(0, 64)
    return w, d, a + b * w + c * d + rng.gauss(0, noise)


def test_learner_starts_at_the_prior_and_learns_each_engine_apart() -> None:
    routing = RoutingConfig(prior_prefill_tokens_per_s=5000, prior_kv_transfer_tokens_per_s=50_000)
    learner = SpeedLearner(speed_prior(routing))
    assert learner.speed("d0").per_token_s == 1 / 5000
    assert learner.speed("d0").samples == 0
    assert learner.transfer().per_token_s == 1 / 50_000
    rng = random.Random(1)
    for _ in range(200):
        w, d, y = _engine(rng, 0.01, 5e-5, 1e-3, 0.001)
        learner.observe_first_token("fast", w, d, y)
        w, d, y = _engine(rng, 0.01, 5e-4, 1e-3, 0.001)
        learner.observe_first_token("slow", w, d, y)
        n = rng.uniform(100, 5000)
        learner.observe_transfer(n, 0.002 + 4e-6 * n)
    assert learner.speed("fast").per_token_s < learner.speed("slow").per_token_s / 5
    assert learner.speed("fast").samples == 200
    assert abs(learner.transfer().per_token_s - 4e-6) < 1e-6


def test_learner_measures_characters_per_token_and_what_races_are_worth() -> None:
    learner = SpeedLearner(SpeedPrior())
    assert learner.race_saving_share == 0.5  # optimistic until measured
    for _ in range(200):
        learner.observe_prompt(6000, 1000)
        learner.observe_race(0.02, 0.3)
        learner.observe_race(0.0, None)  # a race won at once: no wait measured
    assert abs(learner.chars_per_token - 6.0) < 0.05
    assert abs(learner.mean_prompt_tokens - 1000) < 5
    assert abs(learner.race_wait_s - 0.3) < 0.01
    assert abs(learner.race_saving_share - 0.01) < 0.005
    learner.observe_race(7.0, None)  # a share is at most the whole prompt
    assert learner.race_saving_share <= 0.01 + 0.05


def test_the_race_priors_weigh_as_one_observation() -> None:
    """Five races that saved nothing outweigh the optimistic prior at once (a guess is worth
    one sample), so a router whose memory is right stops racing within a few requests."""
    learner = SpeedLearner(SpeedPrior())
    for _ in range(5):
        learner.observe_race(0.0, 0.02)
    assert learner.race_saving_share == pytest.approx(0.5 / 6)
    assert learner.race_wait_s == pytest.approx((0.005 + 5 * 0.02) / 6)


def test_one_surprising_first_token_cannot_make_an_engine_look_idle() -> None:
    """An engine's own fit stays within a few times the fleet's per-token cost: a first
    token far sooner than the queue ahead implied (a scheduler that interleaves prefills)
    must not make the engine look free whatever its queue, or a load-aware policy sends it
    everything."""
    learner = SpeedLearner(SpeedPrior())
    rng = random.Random(9)
    for i in range(40):  # a loaded fleet: 3 ms per token, first tokens scattered -50%..+80%
        n = rng.uniform(30, 2000) + rng.uniform(0, 3000)
        learner.observe_first_token(f"d{i % 4}", n, rng.randint(0, 8), (0.02 + 3e-3 * n) * rng.uniform(0.5, 1.8))
    fleet = learner.speed("d1").per_token_s
    learner.observe_first_token("d1", 10_000, 2, 0.07)  # 10,000 tokens ahead, answered in 70 ms
    assert learner.speed("d1").per_token_s >= fleet / 4 * 0.99
    assert learner.speed("d1").ttft(10_000, 2) > 5.0


def test_races_are_judged_apart_for_prompts_the_memory_places_and_prompts_it_does_not() -> None:
    """With one router the memory knows where prompts went and races save nothing; behind
    other replicas the prompts this router never saw are found only by racing. The two
    are measured apart, so the one does not talk the router out of the other."""
    learner = SpeedLearner(SpeedPrior())
    for _ in range(30):
        learner.observe_race(0.0, None, placed=True)
        learner.observe_race(0.6, None, placed=False)
    assert learner.race_saving_share < 0.05
    assert learner.race_saving_share_unplaced > 0.5


def test_decode_step_is_learned_with_the_prefills_stall_taken_out() -> None:
    learner = SpeedLearner()
    e, c = 0.008, 2e-4
    b = learner.speed("d0").per_token_s
    rng = random.Random(3)
    for _ in range(300):
        decoding = rng.uniform(1, 60)
        gaps = rng.randint(20, 200)
        prefilled = rng.uniform(0, 20_000)
        seconds = gaps * (e + c * decoding) + b * prefilled
        learner.observe_decode("d0", decoding, gaps, seconds, prefilled)
    step = learner.itl("d0")
    assert step.samples == 300
    assert step.step_s == pytest.approx(e, rel=0.05)
    assert step.per_seq_s == pytest.approx(c, rel=0.05)
    # An engine with no samples of its own is predicted by the fleet's fit.
    assert learner.itl("d1").step_s == pytest.approx(e, rel=0.05)
    # A leg of one token has no gap to learn from.
    learner.observe_decode("d2", 5, 0, 1.0, 0)
    assert learner.itl("d2").samples == 0


def test_an_engines_speed_as_read_follows_every_sample_and_scrape() -> None:
    # speed() keeps its answers between samples: each sample, tier scrape, or change of
    # the fleet must show in the next reading, for the sampled engine and its peers.
    learner = SpeedLearner(SpeedPrior(per_token_s=1e-4))
    before_a, before_b = learner.speed("a"), learner.speed("b")
    learner.observe_first_token("a", 1000, 0, 0.5)  # far slower than the prior
    assert learner.speed("a").per_token_s > before_a.per_token_s
    assert learner.speed("b").per_token_s > before_b.per_token_s  # read from the fleet's fit
    assert learner.speed("a") == SpeedLearner._speed(learner, "a")
    learner.observe_cache_tiers("a", 0, 0, 0.0)
    learner.observe_cache_tiers("a", 100, 100, 0.01)
    assert learner.speed("a").held_per_token_s == pytest.approx(0.5 * 1e-4)
    learner.add_engine("c", prefill_tokens_per_s=1000)
    assert learner.speed("c").per_token_s == pytest.approx(1e-3)
    learner.forget_engine("c")
    assert learner.speed("c").per_token_s == learner.speed("b").per_token_s
