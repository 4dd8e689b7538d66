"""The router following engines' KV-event streams (router/fleet/kv_events.py): a real ZMQ
publisher speaking vLLM's protocol (support/kv_publisher.py) against a started router's
fleet, index and snapshot. The engines' HTTP side is absent (health checks fail): the
streams do not depend on it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from router.admission.spec import parse_request
from router.config.parse import parse_config
from router.config.schema import BackendConfig
from router.dispatch.pipeline import route_query
from router.fleet.kv_events import KvEvents, KvStream
from router.fleet.membership import ADMIN
from router.routing.kv_index import KvHit
from router.server.state import RouterState
from support.cluster import registry_of
from support.kv_publisher import KvPublisher, cleared, removed, stored
from support.polling import eventually
from support.ports import free_port
from support.requirements import require_module

BS = 4
PROMPT = list(range(1000, 1024))  # 6 blocks
H = [f"blk{i}".encode() for i in range(6)]


def block(i: int, parent_known: bool = True) -> dict[str, Any]:
    return stored([H[i]], PROMPT[i * BS : (i + 1) * BS], H[i - 1] if i and parent_known else None)


def backend(name: str, pub: KvPublisher) -> dict[str, Any]:
    return {
        "name": name,
        "url": "http://127.0.0.1:9",  # nothing listens: the stream is all these tests need
        "kv_events_endpoint": pub.endpoint,
        "kv_events_replay_endpoint": pub.replay_endpoint,
    }


def kv_events_of(state: RouterState) -> KvEvents:
    assert state.kv_events is not None  # started with a backend that has a KV-event endpoint
    return state.kv_events


# `await router_with(n, **publisher_kwargs)`: a started router following n new publishers.
RouterWith = Callable[..., Awaitable[RouterState]]


@pytest.fixture
async def publishers() -> AsyncIterator[list[KvPublisher]]:
    pubs: list[KvPublisher] = []
    yield pubs
    for p in pubs:
        p.close()


@pytest.fixture
async def router_with(publishers: list[KvPublisher]) -> AsyncIterator[RouterWith]:
    states: list[RouterState] = []

    async def start(n: int = 1, **pub_kwargs: Any) -> RouterState:
        pubs = [KvPublisher(**pub_kwargs) for _ in range(n)]
        publishers.extend(pubs)
        backends = [backend(f"e{i}", p) for i, p in enumerate(pubs)] or [{"name": "plain", "url": "http://127.0.0.1:9"}]
        raw = {"backends": backends, "kv_events": {"stale_after_s": 30.0}}
        state = RouterState(parse_config(raw), start_engines=False)
        states.append(state)
        await state.start()
        return state

    yield start
    for s in states:
        await s.stop()


async def joined(state: RouterState, name: str, pub: KvPublisher) -> None:
    """Until the SUB socket receives live batches (ZMQ drops what is sent before it joined)."""
    stream = kv_events_of(state).streams[name]

    def live() -> bool:
        if stream.last_live is None:
            pub.publish()
            return False
        return stream.synced

    await eventually(live, what=f"{name}'s stream live")


async def one_joined(
    router_with: RouterWith, publishers: list[KvPublisher]
) -> tuple[RouterState, KvPublisher, KvStream]:
    """A started router following one publisher ("e0"), its stream live."""
    state = await router_with()
    pub = publishers[0]
    await joined(state, "e0", pub)
    return state, pub, kv_events_of(state).streams["e0"]


def hits(state: RouterState) -> dict[str, KvHit]:
    return kv_events_of(state).index.match(PROMPT)


async def test_stored_removed_and_cleared_update_the_index_and_the_snapshot(
    router_with: RouterWith, publishers: list[KvPublisher]
) -> None:
    state, pub, _ = await one_joined(router_with, publishers)
    pub.publish(block(0), stored(H[1:4], PROMPT[4:16], H[0]))
    await eventually(lambda: hits(state) == {"e0": KvHit(16, 0)}, what="stored blocks indexed")
    pub.publish(stored(H[:2], PROMPT[:8], medium="CPU"), removed(H[1:2]))
    await eventually(lambda: hits(state) == {"e0": KvHit(4, 4)}, what="a GPU removal and a CPU copy")
    view = registry_of(state).snapshot().get("e0")
    assert view is not None
    assert view.kv_events_fresh
    # What a planner gets for a request whose prompt came as token ids: both tiers' tokens
    # for the engines whose index is fresh.
    spec = parse_request("completions", orjson.dumps({"model": "m", "prompt": PROMPT}))
    assert state.prompt_index is not None
    query = await state.prompt_index.annotate(route_query(spec), False, spec.body, registry_of(state).snapshot(), None)
    assert query.indexed == {"e0": 8.0}
    assert query.prompt_tokens == len(PROMPT)
    # All 6 blocks: vLLM looks the 24 tokens up over the first 23, in whole blocks, so it
    # computes the last block again: 20 are of use.
    pub.publish(stored(H[1:], PROMPT[4:], H[0]))
    await eventually(lambda: hits(state) == {"e0": KvHit(24, 0)}, what="the whole prompt on GPU")
    query = await state.prompt_index.annotate(route_query(spec), False, spec.body, registry_of(state).snapshot(), None)
    assert query.indexed == {"e0": 20.0}
    one_more = parse_request("completions", orjson.dumps({"model": "m", "prompt": [*PROMPT, 7]}))
    query = await state.prompt_index.annotate(
        route_query(one_more), False, one_more.body, registry_of(state).snapshot(), None
    )
    assert query.indexed == {"e0": 24.0}
    pub.publish(cleared())
    await eventually(lambda: hits(state) == {"e0": KvHit(0, 0)}, what="cleared")
    text = state.metrics.exposition().decode()
    assert 'cachehit_router_kv_index_blocks{backend="e0",medium="gpu"} 0.0' in text
    assert 'cachehit_router_kv_events_fresh{backend="e0"} 1.0' in text


async def test_a_dropped_batch_is_replayed_before_the_next_one(
    router_with: RouterWith, publishers: list[KvPublisher]
) -> None:
    state, pub, stream = await one_joined(router_with, publishers)
    pub.publish(block(0))
    missing = pub.publish(block(1), drop=True)
    pub.publish(block(2))
    await eventually(lambda: hits(state) == {"e0": KvHit(12, 0)}, what="the gap filled by a replay")
    assert stream.gaps == 1
    assert missing in pub.replay_requests
    assert stream.lost == 0


async def test_a_backlog_longer_than_one_read_is_applied_whole_and_in_order(
    router_with: RouterWith, publishers: list[KvPublisher]
) -> None:
    state, pub, stream = await one_joined(router_with, publishers)
    # Sent at once, several times what the subscriber reads between two turns of the loop:
    # a block stored and removed over and over, stored by the last batch.
    for _ in range(200):
        pub.publish(block(0))
        pub.publish(removed(H[:1]))
    last = pub.publish(block(0))
    await eventually(lambda: stream.expected == last + 1, what="every batch of the backlog applied")
    assert hits(state) == {"e0": KvHit(4, 0)}
    assert (stream.gaps, stream.lost) == (0, 0)


async def test_a_restarted_publisher_clears_and_rebuilds(
    router_with: RouterWith, publishers: list[KvPublisher]
) -> None:
    state, pub, stream = await one_joined(router_with, publishers)
    pub.publish(block(0), block(1), block(2))
    await eventually(lambda: hits(state) == {"e0": KvHit(12, 0)}, what="before the restart")
    pub.restart()
    pub.publish(block(0), drop=True)  # lost on the wire: the rebuild replays it from 0
    pub.publish(block(1))
    await eventually(lambda: hits(state) == {"e0": KvHit(8, 0)}, what="rebuilt after the restart")
    assert (stream.restarts, stream.gaps) == (1, 0)
    assert kv_events_of(state).index.stats("e0").blocks == 2
    assert pub.replay_requests[-1] == 0


async def checked_by_hand(router_with: RouterWith, publishers: list[KvPublisher]) -> tuple[RouterState, KvPublisher]:
    """A started router following one publisher ("e0"), its stream live, its health checks
    stopped (nothing listens): the test drives them by hand."""
    state = await router_with()
    assert state.monitor is not None
    await state.monitor.stop()
    await joined(state, "e0", publishers[0])
    return state, publishers[0]


async def down_and_back(state: RouterState, pub: KvPublisher) -> None:
    """Engine "e0" seen healthy, then down, then answering again (its checks driven by hand):
    until its stream has been rebuilt from a replay from 0."""
    registry, stream = registry_of(state), kv_events_of(state).streams["e0"]
    registry.record_scrape("e0", {}, None)
    await eventually(lambda: stream.seen_healthy, what="seen healthy")
    registry.record_scrape_failure("e0", "refused")
    await eventually(lambda: stream.was_down, what="seen down")
    asked = len(pub.replay_requests)
    registry.record_scrape("e0", {}, None)
    await eventually(lambda: pub.replay_requests[asked:] == [0] and stream.synced, what="rebuilt from a replay from 0")


async def test_an_engine_answering_again_after_it_was_down_is_rebuilt_from_its_replay(
    router_with: RouterWith, publishers: list[KvPublisher]
) -> None:
    state, pub = await checked_by_hand(router_with, publishers)
    pub.publish(block(0), block(1))
    await eventually(lambda: hits(state) == {"e0": KvHit(8, 0)}, what="indexed")
    await down_and_back(state, pub)
    await eventually(lambda: hits(state) == {"e0": KvHit(8, 0)}, what="rebuilt")


async def test_live_chains_no_leg_of_this_router_began_are_others_sequences_and_a_rebuild_adds_none(
    router_with: RouterWith, publishers: list[KvPublisher]
) -> None:
    state, pub = await checked_by_hand(router_with, publishers)
    registry = registry_of(state)
    stream, seqs = kv_events_of(state).streams["e0"], registry.states["e0"].sequences
    pub.publish(block(0), block(1))  # a prompt's block and the next, chained: one sequence
    await eventually(lambda: seqs.began_others == 1, what="another replica's sequence")
    view = registry.snapshot().get("e0")
    assert view is not None
    assert view.others_seen
    assert 'cachehit_router_kv_events_others_sequences{backend="e0"} 1.0' in state.metrics.exposition().decode()
    ticket = registry.open_leg("e0", 8)  # this router's own prompt there...
    applied = stream.batches
    pub.publish(stored([b"own0", b"own1"], list(range(8))))  # ... begins its own chain
    await eventually(lambda: stream.batches > applied, what="its blocks' batch applied")
    assert seqs.began_others == 1
    registry.close_leg(ticket)
    # The engine's history, replayed when it answers again, is not what it runs now.
    await down_and_back(state, pub)
    assert seqs.began_others == 1


async def test_a_payload_that_does_not_decode_is_counted_and_the_stream_goes_on(
    router_with: RouterWith, publishers: list[KvPublisher]
) -> None:
    state, pub, _ = await one_joined(router_with, publishers)
    pub.send_raw(b"\xc1not msgpack")
    pub.publish(block(0))
    await eventually(lambda: hits(state) == {"e0": KvHit(4, 0)}, what="the next batch indexed")
    assert kv_events_of(state).streams["e0"].decode_errors == 1


async def test_a_backend_added_at_run_time_is_followed_and_a_removed_one_forgotten(
    router_with: RouterWith, publishers: list[KvPublisher]
) -> None:
    state = await router_with()
    late = KvPublisher()
    publishers.append(late)
    late.publish(block(0), block(1))  # before the router subscribes: its replay brings them
    config = BackendConfig(
        name="late",
        url="http://127.0.0.1:9",
        kv_events_endpoint=late.endpoint,
        kv_events_replay_endpoint=late.replay_endpoint,
    )
    assert state.fleet is not None
    await state.fleet.add(config, ADMIN)
    await eventually(lambda: hits(state).get("late") == KvHit(8, 0), what="the added backend's blocks")
    await joined(state, "late", late)
    late.publish(block(2))
    await eventually(lambda: hits(state).get("late") == KvHit(12, 0), what="its live batches")
    assert state.fleet is not None
    await state.fleet.remove("late")
    assert "late" not in kv_events_of(state).streams
    assert "late" not in hits(state)
    assert 'backend="late"' not in state.metrics.exposition().decode()


async def test_without_a_replay_socket_a_gap_clears_the_engine_and_a_late_stream_is_not_fresh(
    router_with: RouterWith, publishers: list[KvPublisher]
) -> None:
    state = await router_with(replay=False)
    pub = publishers[0]
    await joined(state, "e0", pub)
    stream = kv_events_of(state).streams["e0"]
    pub.publish(block(0))
    await eventually(lambda: hits(state) == {"e0": KvHit(4, 0)}, what="indexed")
    pub.publish(block(1), drop=True)
    pub.publish(block(2))  # its parent was in the lost batch: an orphan
    await eventually(lambda: stream.lost == 1, what="the gap seen")
    assert hits(state) == {"e0": KvHit(0, 0)}
    assert kv_events_of(state).index.stats("e0").orphans == 1
    assert registry_of(state).snapshot().backends[0].kv_events_fresh
    pub.publish(block(0), ts=time.time() - 300)  # published long ago: the stream is behind
    await eventually(lambda: not registry_of(state).snapshot().backends[0].kv_events_fresh, what="not fresh")


async def test_vllms_own_publisher_is_followed_replay_included(router_with: RouterWith) -> None:
    """vLLM's ZmqEventPublisher (PUB and replay ROUTER) as the engine: what it published
    before the router subscribed comes through its replay socket, the rest live."""
    v = require_module("vllm.distributed.kv_events")

    port, replay_port = free_port(), free_port()
    publisher = v.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}")
    try:

        def publish(*events: Any) -> None:
            publisher.publish(v.KVEventBatch(ts=time.time(), events=list(events)))

        def vllm_block(i: int) -> Any:  # a vllm.distributed.kv_events.BlockStored
            return v.BlockStored(
                block_hashes=[H[i]], parent_block_hash=H[i - 1] if i else None,
                token_ids=PROMPT[i * BS : (i + 1) * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None,
            )  # fmt: skip

        publish(vllm_block(0), vllm_block(1))
        state = await router_with(0)
        config = BackendConfig(
            name="vllm",
            url="http://127.0.0.1:9",
            kv_events_endpoint=f"tcp://127.0.0.1:{port}",
            kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        )
        assert state.fleet is not None
        await state.fleet.add(config, ADMIN)
        await eventually(lambda: hits(state).get("vllm") == KvHit(8, 0), what="replayed from vLLM's buffer")
        stream = kv_events_of(state).streams["vllm"]
        live = stream.batches

        def joined_live() -> bool:
            publish()
            return stream.last_live is not None

        await eventually(joined_live, what="vLLM's live stream")
        assert stream.batches > live
        publish(vllm_block(2), v.BlockRemoved(block_hashes=[H[0]], medium="GPU"))
        await eventually(lambda: hits(state).get("vllm") == KvHit(0, 0), what="live stores and removals")
        assert kv_events_of(state).index.stats("vllm").blocks == 2
        assert (stream.decode_errors, stream.lost) == (0, 0)
    finally:
        await asyncio.to_thread(publisher.shutdown)


async def test_a_dp_rank_indexes_only_batches_of_its_own_rank(publishers: list[KvPublisher]) -> None:
    # A rank's endpoint that reaches another rank's publisher (ports not offset by the rank)
    # would put that rank's cache under this backend: its batches are refused, counted.
    pub = KvPublisher(rank=0)
    publishers.append(pub)
    raw = {
        "backends": [{**backend("e", pub), "data_parallel_size": 2, "data_parallel_rank": 1}],
        "kv_events": {"stale_after_s": 30.0},
    }
    state = RouterState(parse_config(raw), start_engines=False)
    await state.start()
    try:
        await joined(state, "e", pub)
        errors_before = kv_events_of(state).streams["e"].decode_errors
        seq = pub.publish(block(0))
        stream = kv_events_of(state).streams["e"]
        await eventually(lambda: (stream.expected or 0) > seq, what="the other rank's batch read")
        assert hits(state) == {}
        assert stream.decode_errors == errors_before + 1
    finally:
        await state.stop()
