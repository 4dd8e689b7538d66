"""The online fit behind every learned speed (router/routing/online_fit.py): it recovers a
speed far from its prior, shrugs off outliers, follows a real change, and its written-out
two- and three-coefficient updates compute exactly what the general form does."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.routing.online_fit import OnlineLinear


def _engine(rng: random.Random, a: float, b: float, c: float, noise: float) -> tuple[float, float, float]:
    w, d = rng.uniform(0, 8000), rng.uniform(0, 64)
    return w, d, a + b * w + c * d + rng.gauss(0, noise)


def test_online_fit_recovers_an_engine_speed_far_from_its_prior() -> None:
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


def test_online_fit_shrugs_off_outliers_and_follows_a_real_change() -> None:
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


def _general(fit: OnlineLinear, x: tuple[float, ...], y: float) -> None:
    """`observe` through the general form (the reference the written-out updates match)."""
    if fit._observe_any(x, y):
        fit._bound_and_count()


_VALUE = st.floats(min_value=0.0, max_value=8000.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    three=st.booleans(),
    samples=st.lists(st.tuples(_VALUE, _VALUE, st.floats(min_value=-1.0, max_value=30.0)), min_size=1, max_size=60),
)
def test_the_written_out_updates_are_the_general_form(three: bool, samples: list[tuple[float, float, float]]) -> None:
    prior, sd = ((0.02, 1e-4, 1e-4), (0.3, 1e-3, 1e-3)) if three else ((0.01, 1e-4), (0.15, 1e-3))
    fast, reference = OnlineLinear(prior, sd), OnlineLinear(prior, sd)
    for w, d, y in samples:
        x = (1.0, w, d) if three else (1.0, d)
        fast.observe(x, y)
        _general(reference, x, y)
        # The same operations in the same order: equal to the last bit.
        assert (fast.theta, fast._p, fast._resid, fast.samples) == (
            reference.theta,
            reference._p,
            reference._resid,
            reference.samples,
        )
