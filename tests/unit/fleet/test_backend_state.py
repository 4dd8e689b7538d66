"""One backend's state (router/fleet/backend_state.py): what it says of the sequences
decoding there."""

from __future__ import annotations

from router.config.schema import BackendConfig
from router.fleet.backend_state import BackendState


def test_decoding_as_scraped_counts_this_routers_legs_and_others_running() -> None:
    s = BackendState(BackendConfig("d0", "http://d0"), ())
    s.decoding = 2
    s.others.observe(running=5.0, waiting=0.0, own_prefilling=0.0, own_decoding=2.0, now=0.0)
    assert s.scraped_decoding == 5.0
