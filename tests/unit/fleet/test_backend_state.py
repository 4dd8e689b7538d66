"""One backend's state (router/fleet/backend_state.py): what it says of the sequences
decoding there and of this router's prompts still waiting for their first token."""

from __future__ import annotations

from router.config.schema import BackendConfig
from router.fleet.backend_state import BackendState
from router.fleet.legs import PendingQueue


def test_decoding_as_scraped_counts_this_routers_legs_and_others_running() -> None:
    s = BackendState(BackendConfig("d0", "http://d0"), ())
    s.decoding = 2
    s.others.observe(running=5.0, waiting=0.0, own_prefilling=0.0, own_decoding=2.0, now=0.0)
    assert s.scraped_decoding == 5.0


def test_pending_prompts_are_the_queue_this_router_sent_and_whether_others_wait_ahead() -> None:
    s = BackendState(BackendConfig("d0", "http://d0"), ())
    s.queued_tokens, s.queue_since, s.decoding = 700, 1.5, 1
    assert s.pending() == PendingQueue("d0", 700, 1.5, 1.0, False)
    s.others.observe(running=1.0, waiting=3.0, own_prefilling=1.0, own_decoding=1.0, now=2.0)
    assert s.pending().others_waiting
