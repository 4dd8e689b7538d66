"""Fixtures every test directory shares (helpers: the `support` package next to this file).

Where a test goes:
- `unit/`: the router's modules on their own, no sockets and no processes (the race and the
  dispatcher against fake upstream streams); one file per module, `unit/<package>/test_<module>.py`
  mirroring `router/<package>/<module>.py` (unit/test_package_layout.py checks it); seconds
  in all, CI's first tests;
- `integration/`: a running router in front of simulated engines in this process (aiohttp);
- `sim/`: the simulator against vLLM's wire format; `launcher/`: the engine launcher;
- `reliability/`: failures, hostile input, overload, shutdown, security;
- `bench/`: the benchmark tooling on tiny runs; `deploy/`: the Kubernetes manifests;
- `real_engine/` (marker `real_engine`): real vLLM CPU engines with the plugin, and NIXL.

A missing dependency skips a test only through support/requirements.py, which fails it
instead when CI requires every test to run (CACHEHIT_REQUIRE_REAL_ENGINE).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.processes import signal_group


@pytest.fixture
def kill_leftovers() -> Iterator[list[int]]:
    """Process groups a test registers are SIGKILLed at teardown if still alive (by pgid)."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        signal_group(pgid)
