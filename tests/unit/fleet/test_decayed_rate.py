"""A decayed rate (router/fleet/decayed_rate.py), here of the prompt work placed lately: read unbiased
from its first sample on."""

from __future__ import annotations

import math

import pytest

from router.fleet.decayed_rate import DecayedRate


def test_a_steady_stream_reads_as_its_rate_from_the_start() -> None:
    w = DecayedRate(window_s=10.0)
    assert w.per_s(0.0) == 0.0
    # 1,000 tokens every 0.1 s: 10,000 tokens/s, read as such after 2 s (the first sample's
    # own 0.1 s not covered: ~5% high) and after 60 s alike.
    t = 0.0
    for _ in range(600):
        t += 0.1
        w.add(1000.0, t)
        if abs(t - 2.0) < 1e-9:
            assert w.per_s(t) == pytest.approx(10_000.0, rel=0.06)
    assert w.per_s(t) == pytest.approx(10_000.0, rel=0.01)


def test_silence_decays_it_and_a_first_prompt_is_not_a_flood() -> None:
    w = DecayedRate(window_s=10.0)
    w.add(5000.0, 100.0)
    assert w.per_s(100.0) == 5000.0  # over 1 s at least, not over an instant
    for i in range(1, 101):
        w.add(1000.0, 100.0 + 0.1 * i)
    busy = w.per_s(110.0)
    # 10 s of silence: the sum decays by e^-1, and it has covered 20 s instead of 10.
    covered = (1 - math.exp(-2.0)) / (1 - math.exp(-1.0))
    assert w.per_s(120.0) == pytest.approx(busy * math.exp(-1.0) / covered)
    assert w.per_s(200.0) < busy / 1000.0
