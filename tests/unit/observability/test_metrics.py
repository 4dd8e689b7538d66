"""Router metrics: a backend that leaves the fleet takes every series labelled with it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from router.names import BreakerState, Verdict
from router.observability.metrics import RouterMetrics, request_fields
from router.observability.record import EngineVerdict, RequestRecord


@dataclass
class _Named:
    name: str


@dataclass
class _Backend:
    config: _Named
    inflight: int = 0
    healthy: bool = True
    breaker: BreakerState = BreakerState.CLOSED
    draining: bool = False
    queued_tokens: float = 0.0
    threshold_capable: bool | None = True


@dataclass
class _Speed:
    per_token_s: float = 1e-4


class _Learner:
    def speed(self, name: str) -> _Speed:
        return _Speed()


def _record_touching(*backends: str) -> RequestRecord:
    rec = RequestRecord(request_id="r", endpoint="/v1/completions", model="m", stream=True)
    for b in backends:
        rec.verdicts += [
            EngineVerdict(b, Verdict.REJECTED, 0.01),
            EngineVerdict(b, Verdict.LOST, 0.01, tokens=3),
            EngineVerdict(b, Verdict.EXPIRED, 0.5),
        ]
        rec.retried_backends.append(b)
        rec.upstream_errors += [(b, "connect"), (b, "status")]
    return rec


def _series_of(metrics: RouterMetrics, backend: str) -> list[str]:
    text = metrics.exposition().decode()
    return [line for line in text.splitlines() if f'backend="{backend}"' in line]


def test_a_removed_backend_leaves_no_series_behind() -> None:
    metrics = RouterMetrics()
    for name in ("gone", "kept"):
        metrics.bind_backend(_Backend(_Named(name)), _Learner(), lambda: False)
    metrics.record(_record_touching("gone", "kept"))
    assert any("probe_rejections" in line for line in _series_of(metrics, "gone"))
    assert any("upstream_errors" in line for line in _series_of(metrics, "gone"))

    metrics.unbind_backend("gone")

    assert _series_of(metrics, "gone") == []
    kept = _series_of(metrics, "kept")
    for family in ("probe_rejections", "probe_losers", "probe_deadline_expiries", "retries", "upstream_errors"):
        assert any(family in line for line in kept), family


def test_the_slow_gauge_reads_the_stall_watch_when_scraped() -> None:
    metrics = RouterMetrics()
    slow = {"d0": False}
    metrics.bind_backend(_Backend(_Named("d0")), _Learner(), lambda: slow["d0"])
    assert 'cachehit_router_backend_slow{backend="d0"} 0.0' in _series_of(metrics, "d0")
    slow["d0"] = True
    assert 'cachehit_router_backend_slow{backend="d0"} 1.0' in _series_of(metrics, "d0")


def test_a_request_ending_after_its_engine_left_does_not_bring_the_series_back() -> None:
    metrics = RouterMetrics()
    metrics.bind_backend(_Backend(_Named("gone")), _Learner(), lambda: False)
    metrics.unbind_backend("gone")
    metrics.record(_record_touching("gone"))
    assert _series_of(metrics, "gone") == []


def test_a_backend_added_again_under_its_name_is_counted_again() -> None:
    metrics = RouterMetrics()
    metrics.bind_backend(_Backend(_Named("back")), _Learner(), lambda: False)
    metrics.unbind_backend("back")
    metrics.bind_backend(_Backend(_Named("back")), _Learner(), lambda: False)
    metrics.record(_record_touching("back"))
    assert any("probe_rejections" in line for line in _series_of(metrics, "back"))


def test_the_request_line_is_written_unless_request_log_is_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cachehit_router.requests")
    rec = _record_touching("d0")
    RouterMetrics(request_log=False).record(rec)
    assert [r for r in caplog.records if r.name == "cachehit_router.requests"] == []
    RouterMetrics().record(rec)
    (line,) = [r.__dict__["request"] for r in caplog.records if r.name == "cachehit_router.requests"]
    assert line == request_fields(rec)
    assert list(line)[:6] == ["request_id", "endpoint", "model", "stream", "tenant", "route"]
    assert (line["probes"], line["rejections"], line["expired"], line["losers"]) == (
        rec.probes,
        rec.rejections,
        rec.expired,
        rec.losers,
    )
