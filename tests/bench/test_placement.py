"""Where a run's requests went (bench/harness/placement.py): repeats of a tag sent back to
an engine that served it, and per engine the predicted against the observed TTFT."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.harness.placement import per_engine, repeat_placement, report


def _row(
    start: float, tag: str, winner: str, cached: int = 0, predicted: float = 120.0, observed: float = 110.0
) -> dict[str, Any]:
    return {
        "start_s": start,
        "tag": tag,
        "winner": winner,
        "cached_tokens": cached,
        "predicted_ttft_ms": predicted,
        "router_ttft_ms": observed,
    }


ROWS = [
    _row(0.0, "g0", "d0"),
    _row(0.1, "g1", "d1"),
    _row(0.2, "g0", "d1"),  # a repeat, to an engine that never served g0
    _row(0.3, "g0", "d0", cached=2000, observed=15.0),  # to a holder, not the last one
    _row(0.4, "g1", "d1", cached=2000, observed=14.0),  # to a holder, the last one
]


def test_repeats_are_counted_against_the_engines_that_served_their_tag() -> None:
    rp = repeat_placement(ROWS)
    assert (rp.repeats, rp.to_a_holder, rp.to_the_last, rp.engines) == (3, 2 / 3, 1 / 3, 2)


def test_per_engine_splits_hits_from_misses() -> None:
    d0 = per_engine(ROWS)["d0"]
    assert (d0["requests"], d0["hits"]) == (2, 1)
    assert (d0["miss_observed_ms"], d0["hit_observed_ms"], d0["hit_predicted_ms"]) == (110.0, 15.0, 120.0)


def test_report_reads_a_run_directory(tmp_path: Path) -> None:
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    text = report(tmp_path)
    assert "3 repeat a tag" in text
    assert "d1" in text
