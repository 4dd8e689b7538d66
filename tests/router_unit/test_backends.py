"""Backend registry: circuit breaker, in-flight counts, scraped load, snapshot."""

from router.config.schema import BackendConfig, HealthConfig
from router.engine.scrape import parse_load_metrics
from router.fleet.registry import BackendRegistry
from router.names import BreakerState


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def registry(clock, threshold=3, cooldown=5.0):
    cfgs = [BackendConfig("a", "http://a"), BackendConfig("p", "http://p", role="prefill")]
    r = BackendRegistry(cfgs, HealthConfig(failure_threshold=threshold, cooldown_s=cooldown), clock=clock)
    for n in ("a", "p"):
        r.record_scrape(n, {}, None)
    return r


def test_breaker_opens_after_consecutive_failures_and_recovers_through_half_open():
    clock = Clock()
    r = registry(clock)
    assert r.snapshot().get("a").available
    r.record_failure("a", "x")
    r.record_failure("a", "x")
    assert r.states["a"].breaker == BreakerState.CLOSED
    assert r.snapshot().get("a").available
    r.record_failure("a", "x")
    assert r.states["a"].breaker == BreakerState.OPEN
    assert not r.snapshot().get("a").available
    assert not r.ready()  # the only decoder is open
    clock.t += 5.0
    assert r.snapshot().get("a").available  # cool-down over: one trial allowed
    r.acquire("a")
    assert r.states["a"].breaker == BreakerState.HALF_OPEN
    assert not r.snapshot().get("a").available
    r.release("a")
    r.record_failure("a", "still broken")
    assert r.states["a"].breaker == BreakerState.OPEN
    clock.t += 5.0
    r.acquire("a")
    r.release("a")
    r.record_success("a")
    assert r.states["a"].breaker == BreakerState.CLOSED
    assert r.snapshot().get("a").available
    assert r.ready()


def test_success_resets_the_failure_count():
    r = registry(Clock())
    r.record_failure("a", "x")
    r.record_failure("a", "x")
    r.record_success("a")
    r.record_failure("a", "x")
    assert r.states["a"].breaker == BreakerState.CLOSED


def test_scrape_failure_marks_unhealthy_until_it_answers():
    r = registry(Clock(), threshold=100)
    r.record_scrape_failure("a", "refused")
    assert not r.snapshot().get("a").available
    r.record_scrape("a", {"vllm:num_requests_waiting": 3.0}, None)
    v = r.snapshot().get("a")
    assert v.available
    assert v.waiting == 3.0


def test_inflight_counts_and_load():
    r = registry(Clock())
    r.acquire("a")
    r.acquire("a")
    assert r.snapshot().get("a").inflight == 2
    assert r.snapshot().get("a").load == 2
    r.release("a")
    r.record_scrape("a", {"vllm:num_requests_running": 4.0, "vllm:num_requests_waiting": 1.0}, None)
    assert r.snapshot().get("a").load == 5.0


def test_models_come_from_config_or_discovery():
    r = BackendRegistry(
        [BackendConfig("a", "http://a"), BackendConfig("b", "http://b", models=("m2",))], HealthConfig()
    )
    r.record_scrape("a", {}, ("m1",))
    r.record_scrape("b", {}, ("ignored",))
    assert r.models() == ["m1", "m2"]


def test_parse_load_metrics_sums_label_sets():
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 99.0
"""
    assert parse_load_metrics(text) == {
        "vllm:num_requests_running": 5.0,
        "vllm:num_requests_waiting": 7.0,
        "vllm:kv_cache_usage_perc": 0.25,
    }


def test_ambiguous_check_failures_need_the_threshold_definitive_ones_do_not():
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


def test_panic_routing_when_no_decoder_is_available():
    r = registry(Clock(), threshold=1)
    r.record_scrape_failure("a", "refused")
    snap = r.snapshot()
    assert not snap.get("a").available
    assert [b.name for b in snap.decoders(None)] == ["a"]  # nothing available: try them all
    assert snap.prefillers(None)[0].name == "p"  # prefill backends never panic: the fallback goes direct
    r.record_scrape_failure("p", "refused")
    assert r.snapshot().prefillers(None) == []
