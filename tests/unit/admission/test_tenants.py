"""Tenants' limits (router/admission/tenants.py): the token bucket behind a tenant's rate."""

from __future__ import annotations

import pytest

from router.admission.tenants import TokenBucket


def test_token_bucket_refills_at_its_rate_up_to_the_burst() -> None:
    b = TokenBucket(rate=2.0, burst=3)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.5)
    assert b.take(0.5) == 0.0
    assert b.take(0.5) == pytest.approx(0.5)
    assert [b.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]  # no more than the burst
    assert b.take(100.0) > 0
