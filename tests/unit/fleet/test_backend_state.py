"""One backend's state (router/fleet/backend_state.py): what it says of the sequences
decoding there and of the room in its KV cache."""

from __future__ import annotations

from router.config.schema import BackendConfig
from router.fleet.backend_state import BackendState
from router.routing.costmodel import NO_ROOM_LIMIT, KvRoom


def test_decoding_as_scraped_counts_this_routers_legs_and_others_running() -> None:
    s = BackendState(BackendConfig("d0", "http://d0"), ())
    s.decoding = 2
    s.others.observe(running=5.0, waiting=0.0, own_prefilling=0.0, own_decoding=2.0, now=0.0)
    assert s.scraped_decoding == 5.0


def test_kv_room_is_the_scrape_moved_by_this_routers_legs_since() -> None:
    s = BackendState(BackendConfig("d0", "http://d0"), ())
    assert s.kv_room(2.0) is NO_ROOM_LIMIT  # no cache config scraped: never a wait
    # A scrape: 10,000 tokens of KV, 60% held by 4 running sequences (1,500 each).
    s.kv_capacity, s.kv_usage, s.running = 10_000.0, 0.6, 4.0
    s.prefilled_tokens, s.legs_closed = 5_000, 3
    s.prefilled_at_scrape, s.closed_at_scrape = 5_000, 3
    assert s.kv_room(2.0) == KvRoom(10_000.0, 6_000.0, 2.0)
    # Since: 2,000 prompt tokens prefilled for this router's legs, one of its legs ended.
    s.prefilled_tokens, s.legs_closed = 7_000, 4
    assert s.kv_room(2.0) == KvRoom(10_000.0, 6_000.0 + 2_000.0 - 1_500.0, 2.0)
    s.legs_closed = 40  # more ended than the scrape saw running: nothing held, not less
    assert s.kv_room(2.0).used_tokens == 0.0
