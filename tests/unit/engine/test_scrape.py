"""The engine metrics the router scrapes (router/engine/scrape.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.engine.scrape import (
    CACHED_BY_SOURCE,
    ENGINE_CORES,
    KV_USAGE,
    OFFLOAD_LOAD_TIME,
    RUNNING,
    WAITING,
    _library_parse,
    parse_load_metrics,
)

VLLM_METRICS = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_wire" / "metrics.json"


def test_parse_load_metrics_sums_label_sets() -> None:
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
        ENGINE_CORES: 2.0,  # engine="0" and engine="1": a server with two DP ranks
    }


def test_parse_load_metrics_of_one_engine_core_reads_only_its_samples() -> None:
    # A data-parallel server labels each rank's samples engine="<rank>": a rank's backend
    # reads its own load, not the server's.
    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
"""
    one = {ENGINE_CORES: 1.0}
    assert parse_load_metrics(text, "1") == {"vllm:num_requests_running": 2.0, "vllm:num_requests_waiting": 1.0, **one}
    assert parse_load_metrics(text, "0") == {"vllm:num_requests_running": 3.0, "vllm:num_requests_waiting": 7.0, **one}


def test_a_page_that_is_not_an_exposition_still_fails_the_check() -> None:
    # Read by prometheus_client's parser when vLLM's gauge is missing: it raises, and the
    # health check counts the engine as failed, as before the hand-written scan.
    with pytest.raises(ValueError, match="invalid metric name"):
        parse_load_metrics("<html><body>502 Bad Gateway</body></html>")
    assert parse_load_metrics("process_cpu_seconds_total 1.5\n") == {}


def _real_vllm_page(values: dict[str, float]) -> str:
    """A /metrics page with every family and label set a real vLLM server exposed
    (tests/fixtures/vllm_wire/metrics.json), each sample valued from `values` by name."""
    lines = []
    for name, fam in json.loads(VLLM_METRICS.read_text())["families"].items():
        lines += [f"# HELP {name} {fam['help']}", f"# TYPE {name} {fam['type']}"]
        lines += [f"{s} {values.get(s.split('{')[0], 1.0)}" for s in fam["samples"]]
    return "\n".join(lines) + "\n"


def test_real_vllm_page_reads_as_through_prometheus_client() -> None:
    text = _real_vllm_page({RUNNING: 3.0, WAITING: 2.0, KV_USAGE: 0.5, CACHED_BY_SOURCE + "_total": 7.0})
    assert parse_load_metrics(text) == _library_parse(text, None)
    assert parse_load_metrics(text, "0") == _library_parse(text, "0")
    assert parse_load_metrics(text)[RUNNING] == 3.0


# Model names that need escaping, one that reads as another engine's label if the scan
# took an escaped quote for the end of a value.
_LABEL_TEXT = st.text(alphabet=st.sampled_from('ab0}{"\\\n ,='), max_size=6) | st.just('m",engine="9')


@st.composite
def _expositions(draw: st.DrawFn) -> str:
    """A page written by prometheus_client (the exporter vLLM uses) with any subset of the
    families the router reads, in any label sets, between families whose names share their
    prefix, and with label values that need escaping."""
    reg = CollectorRegistry()
    engines = st.sampled_from(["0", "1", "2"])
    for name in (RUNNING, WAITING, KV_USAGE, RUNNING + "_by_adapter"):
        if draw(st.booleans()):
            gauge = Gauge(name, "h", ["model_name", "engine"], registry=reg)
            for _ in range(draw(st.integers(0, 3))):
                gauge.labels(draw(_LABEL_TEXT), draw(engines)).set(draw(st.floats(0, 1e6)))
    if draw(st.booleans()):
        hits = Counter(CACHED_BY_SOURCE, "h", ["model_name", "source", "engine"], registry=reg)
        for _ in range(draw(st.integers(0, 4))):
            source = draw(st.sampled_from(["device", "host", "disk", "p2p"]))
            hits.labels(draw(_LABEL_TEXT), source, draw(engines)).inc(draw(st.floats(0, 1e9)))
    if draw(st.booleans()):
        load = Counter(OFFLOAD_LOAD_TIME, "h", ["engine"], registry=reg)
        for _ in range(draw(st.integers(0, 2))):
            load.labels(draw(engines)).inc(draw(st.floats(0, 1e3)))
    if draw(st.booleans()):
        Histogram(WAITING + "_seconds", "h", ["engine"], registry=reg).labels("0").observe(0.3)
    return generate_latest(reg).decode()


@given(_expositions(), st.sampled_from([None, "0", "1"]))
def test_scan_reads_what_prometheus_client_reads(text: str, engine: str | None) -> None:
    assert parse_load_metrics(text, engine) == _library_parse(text, engine)


def test_a_label_value_with_escapes_does_not_hide_the_labels_after_it() -> None:
    # `\"` then `\n=`: read up to its first quote, the value left `n="...` opening a label.
    sample = 'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="\\"\\n=",source="device"} 5.0\n'
    head = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n"
    text = head + "# TYPE vllm:prompt_tokens_cached_by_source_total counter\n" + sample
    assert parse_load_metrics(text)[CACHED_BY_SOURCE + ":device"] == 5.0
    assert parse_load_metrics(text) == _library_parse(text, None)


def test_family_without_type_line_reads_as_zero_for_an_engine_without_samples() -> None:
    # No `# TYPE` line (a hand-written exporter): rank 1 has none of the samples, and its
    # gauges read 0 rather than missing, as through prometheus_client.
    text = 'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_waiting{engine="0"} 1\n'
    expected = {RUNNING: 0.0, WAITING: 0.0, ENGINE_CORES: 0.0}
    assert parse_load_metrics(text, "1") == _library_parse(text, "1") == expected
