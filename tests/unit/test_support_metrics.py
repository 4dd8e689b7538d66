"""Metric reads in tests (support/metrics.py): a metric the exposition does not declare,
or a label set with no sample, fails the read; only `sample_or_zero` reads 0, and only for
a declared metric."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from support.metrics import Metrics, parse_metrics, registry_metrics


def _registry() -> CollectorRegistry:
    r = CollectorRegistry()
    requests = Counter("demo_requests", "requests", ["route"], registry=r)
    Gauge("demo_inflight", "in flight", registry=r)
    requests.labels(route="pd").inc(2)
    return r


def _both() -> list[Metrics]:
    r = _registry()
    return [parse_metrics(generate_latest(r).decode()), registry_metrics(r)]


@pytest.mark.parametrize("m", _both(), ids=["scraped", "in-process"])
def test_reads_of_declared_metrics(m: Metrics) -> None:
    assert m.value("demo_requests_total", route="pd") == 2
    assert m.value("demo_requests_total") == 2
    assert m.value("demo_inflight") == 0
    assert m.sample_or_zero("demo_requests_total", route="direct") == 0
    assert m.has("demo_requests_total")
    assert not m.has("demo_renamed_total")


@pytest.mark.parametrize("m", _both(), ids=["scraped", "in-process"])
def test_a_missing_metric_or_label_set_fails(m: Metrics) -> None:
    with pytest.raises(AssertionError, match="demo_renamed_total"):
        m.value("demo_renamed_total")
    with pytest.raises(AssertionError, match="demo_renamed_total"):
        m.sample_or_zero("demo_renamed_total")
    with pytest.raises(AssertionError, match="direct"):
        m.value("demo_requests_total", route="direct")
