"""The cost model's formula, the online fit of engine speeds, and the token-level load."""

import random

import pytest

from router.config.schema import BackendConfig, HealthConfig, RoutingConfig
from router.fleet.registry import BackendRegistry
from router.routing.costmodel import EngineSpeed, TransferSpeed, pd_ttft, ttft
from router.routing.speed_learner import OnlineLinear, SpeedLearner, SpeedPrior, speed_prior


def test_ttft_is_queue_plus_lacking_at_the_engine_speed():
    s = EngineSpeed(intercept_s=0.01, per_token_s=1e-4, per_decode_s=1e-3)
    assert ttft(s, 1000, 0, 500) == 0.01 + 1e-4 * 1500
    assert ttft(s, 0, 20, 0) == 0.01 + 0.02
    # A hit larger than the prompt (an estimate) never makes lacking negative.
    assert ttft(s, 100, 0, -300) == ttft(s, 100, 0, 0)
    # A fit that went negative on a noisy stretch still charges for queued work.
    assert ttft(EngineSpeed(-1.0, -1.0, -1.0), 1000, 10, 0) > 0


def test_prefill_decode_overlaps_the_producer_with_the_consumer_queue():
    fast = EngineSpeed(0.01, 1e-4, 0.0)
    transfer = TransferSpeed(0.005, 1e-5)
    # Idle consumer: prefill + transfer.
    assert pd_ttft(fast, 0, 0, 1000, fast, 0, 0, transfer, 1000) == 0.01 + 0.1 + 0.005 + 0.01
    # A consumer busy for longer than the prefill: its queue decides.
    assert pd_ttft(fast, 0, 0, 1000, fast, 5000, 0, transfer, 1000) == ttft(fast, 5000, 0, 0)


def _engine(rng: random.Random, a: float, b: float, c: float, noise: float):
    w, d = rng.uniform(0, 8000), rng.uniform(0, 64)
    return w, d, a + b * w + c * d + rng.gauss(0, noise)


def test_online_fit_recovers_an_engine_speed_far_from_its_prior():
    rng = random.Random(7)
    fit = OnlineLinear((0.02, 1e-4, 1e-4), (0.3, 1e-3, 1e-3))
    # A slow engine: 40 ms per step, 800 us per token (1,250 tokens/s), 2 ms per sequence.
    for _ in range(300):
        w, d, y = _engine(rng, 0.04, 8e-4, 2e-3, 0.01)
        fit.observe((1.0, w, d), y)
    a, b, c = fit.theta
    assert abs(b - 8e-4) / 8e-4 < 0.05
    assert abs(c - 2e-3) < 5e-4
    assert abs(a - 0.04) < 0.02


def test_online_fit_shrugs_off_outliers_and_follows_a_real_change():
    rng = random.Random(3)
    fit = OnlineLinear((0.02, 1e-4, 1e-4), (0.3, 1e-3, 1e-3))
    for i in range(400):
        w, d, y = _engine(rng, 0.01, 1e-4, 1e-3, 0.002)
        if i % 25 == 24:
            y += 30.0  # a stall: 30 s to the first token
        fit.observe((1.0, w, d), y)
    assert abs(fit.theta[1] - 1e-4) / 1e-4 < 0.15
    # The engine becomes 4x slower (a noisy neighbour): the fit follows within a few hundred samples.
    for _ in range(400):
        w, d, y = _engine(rng, 0.01, 4e-4, 1e-3, 0.002)
        fit.observe((1.0, w, d), y)
    assert abs(fit.theta[1] - 4e-4) / 4e-4 < 0.1


def test_learner_starts_at_the_prior_and_learns_each_engine_apart():
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


def test_learner_measures_characters_per_token_and_what_races_are_worth():
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


def test_the_race_priors_weigh_as_one_observation():
    """Five races that saved nothing outweigh the optimistic prior at once (a guess is worth
    one sample), so a router whose memory is right stops racing within a few requests."""
    learner = SpeedLearner(SpeedPrior())
    for _ in range(5):
        learner.observe_race(0.0, 0.02)
    assert learner.race_saving_share == pytest.approx(0.5 / 6)
    assert learner.race_wait_s == pytest.approx((0.005 + 5 * 0.02) / 6)


def _registry(clock):
    return BackendRegistry([BackendConfig("d0", "http://d0")], HealthConfig(), clock=clock)


def test_leg_tickets_queue_tokens_until_the_first_token_then_count_a_decoding_sequence():
    now = [100.0]
    r = _registry(lambda: now[0])
    r.record_scrape("d0", {}, None)
    a = r.open_leg("d0", 1000)
    b = r.open_leg("d0", 300)
    view = r.snapshot().get("d0")
    assert (view.queued_tokens, view.decoding, view.inflight) == (1300, 0, 2)
    assert (b.queued_ahead, b.decoding) == (1000, 0)  # what was ahead of b when it was sent
    now[0] = 100.25
    r.first_token(a)
    r.first_token(a)  # repeated: no double count
    view = r.snapshot().get("d0")
    assert (view.queued_tokens, view.decoding) == (300, 1)
    r.close_leg(a)
    r.close_leg(a)
    r.close_leg(b)  # closed before its first token (cancelled): its tokens leave the queue
    r.first_token(b)  # too late: ignored
    view = r.snapshot().get("d0")
    assert (view.queued_tokens, view.decoding, view.inflight) == (0, 0, 0)
    # a's sample: 0 ahead + 800 lacking (200 cached), 0.25 s.
    assert r.learn_first_token(a, 800) == 0.25
    assert r.learner.speed("d0").samples == 1
    assert r.learn_first_token(b, 300) is None  # no first token: no sample


def test_scraped_waiting_beyond_our_own_legs_counts_as_other_replicas_traffic():
    r = _registry(lambda: 0.0)
    r.learner.mean_prompt_tokens = 2000
    r.open_leg("d0", 500)
    r.record_scrape("d0", {"vllm:num_requests_waiting": 3.0, "vllm:num_requests_running": 5.0}, None)
    view = r.snapshot().get("d0")
    # Our one leg explains one waiting request; two more at the mean prompt length; the
    # five running are other replicas' too (our only leg is the waiting one).
    assert view.queued_tokens == 500 + 2 * 2000
    assert view.decoding == 5.0


def test_a_scrape_is_a_moment_of_the_past():
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
    view = r.snapshot().get("d0")
    assert (view.queued_tokens, view.decoding) == (0.0, 0.0)
    # Two prompts of another replica waiting at the scrape: 2,000 tokens, drained at the
    # prior's 10,000 tokens/s.
    r.record_scrape("d0", {"vllm:num_requests_waiting": 2.0, "vllm:num_requests_running": 1.0}, None)
    assert r.snapshot().get("d0").queued_tokens == 2000.0
    now[0] = 0.1
    assert r.snapshot().get("d0").queued_tokens == pytest.approx(1000.0)
    now[0] = 0.5
    assert r.snapshot().get("d0").queued_tokens == 0.0
    assert r.snapshot().get("d0").decoding == 1.0


def test_a_backend_added_at_run_time_starts_from_its_own_configured_speed_and_removal_forgets_it():
    r = _registry(lambda: 0.0)
    r.add(BackendConfig("late", "http://late", prefill_tokens_per_s=2000.0))
    assert r.learner.speed("late").per_token_s == 1.0 / 2000.0  # not the fleet-wide prior
    r.set_draining("late", True)
    r.remove("late")
    r.add(BackendConfig("late", "http://elsewhere"))  # another machine under the same name
    assert r.learner.speed("late").per_token_s == r.learner.prior.per_token_s


def test_one_surprising_first_token_cannot_make_an_engine_look_idle():
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


def test_races_are_judged_apart_for_prompts_the_memory_places_and_prompts_it_does_not():
    """With one router the memory knows where prompts went and races save nothing; behind
    other replicas the prompts this router never saw are found only by racing. The two
    are measured apart, so the one does not talk the router out of the other."""
    learner = SpeedLearner(SpeedPrior())
    for _ in range(30):
        learner.observe_race(0.0, None, placed=True)
        learner.observe_race(0.6, None, placed=False)
    assert learner.race_saving_share < 0.05
    assert learner.race_saving_share_unplaced > 0.5
