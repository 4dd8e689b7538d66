"""Fixtures every test directory shares (helpers: the `support` package next to this file)."""

from __future__ import annotations

import pytest

from support.processes import signal_group


@pytest.fixture
def kill_leftovers():
    """Process groups a test registers are SIGKILLed at teardown if still alive (by pgid)."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        signal_group(pgid)
