"""The simulator's KV cache event stream (engine_launcher/sim/kv_events.py), read with real
ZeroMQ sockets as a router reads vLLM's: what a request, an eviction, a reset and the CPU
tier publish, and what replay returns (helpers: support/sim_kv_events.py)."""

from __future__ import annotations

import aiohttp
import zmq
import zmq.asyncio

from engine_launcher.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventsConfig
from support.sim_http import MakeEngine
from support.sim_kv_events import (
    BS,
    END_SEQ,
    TOPIC,
    StartSim,
    complete,
    events_config,
    local,
    stored_tokens,
    wire_hashes,
)


async def test_events_are_off_by_default(make_engine: MakeEngine) -> None:
    eng = await make_engine()
    assert eng.config.kv_events_config is None
    assert eng.engine.kv_events is None
    eng = await make_engine(kv_events_config=KVEventsConfig(endpoint="tcp://*:0"))  # not enabled
    assert eng.engine.kv_events is None


async def test_a_prompts_full_blocks_are_stored_with_their_tokens(sim: StartSim, http: aiohttp.ClientSession) -> None:
    sub = await sim()
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks and 8 tokens
    await complete(http, sub.url, prompt)
    stored = await sub.wait_for(lambda: sub.events(BlockStored), "BlockStored")
    assert stored_tokens(stored) == prompt[:32]
    assert [h for e in stored for h in e.block_hashes] == wire_hashes(prompt)
    first = stored[0]
    assert first.parent_block_hash is None
    assert first.block_size == BS
    assert first.medium == "GPU"
    assert first.lora_name is None
    assert first.lora_id is None
    assert first.group_idx == 0
    assert first.extra_keys == [None] * len(first.block_hashes)
    # One batch per step, numbered one by one.
    seqs = [seq for _, seq, _ in sub.received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(topic == TOPIC.encode() for topic, _, _ in sub.received)
    assert all(batch.data_parallel_rank == 0 for _, _, batch in sub.received)

    # The same prompt again is a cache hit: nothing new is stored.
    before = len(sub.received)
    await complete(http, sub.url, prompt)
    await sub.drain()
    assert not [e for _, _, b in sub.received[before:] for e in b.events if isinstance(e, BlockStored)]


async def test_generated_tokens_fill_blocks_that_are_stored_too(sim: StartSim, http: aiohttp.ClientSession) -> None:
    sub = await sim()
    prompt = list(range(300, 324))  # 24 tokens: 1 full block; 20 generated fill the 2nd
    await complete(http, sub.url, prompt, max_tokens=20, ignore_eos=True)
    stored = await sub.wait_for(lambda: len(stored_tokens(sub.events(BlockStored))) >= 32, "2 blocks stored")
    stored = sub.events(BlockStored)
    tokens = stored_tokens(stored)
    assert len(tokens) == 32
    assert tokens[:24] == prompt
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes[0] == wire_hashes(prompt)[0]
    assert hashes[1] == wire_hashes(tokens)[1]
    assert stored[-1].parent_block_hash == (hashes[0] if len(stored) > 1 else None)


async def test_a_lora_adapters_blocks_name_it_and_hash_apart(sim: StartSim, http: aiohttp.ClientSession) -> None:
    sub = await sim(lora_modules={"base-sql": "/adapters/sql", "chat-fr": "/adapters/fr"})
    prompt = list(range(500, 532))  # 2 full blocks
    await complete(http, sub.url, [*prompt, 1], model="chat-fr")
    stored = await sub.wait_for(lambda: sub.events(BlockStored), "BlockStored")
    assert stored_tokens(stored) == prompt
    for e in stored:
        assert e.lora_name == "chat-fr"
        assert e.lora_id == 2  # numbered from 1 in load order, as vLLM's lora_int_id
        assert e.extra_keys == [("chat-fr",)] * len(e.block_hashes)
    lora_hashes = [h for e in stored for h in e.block_hashes]
    assert lora_hashes == wire_hashes(prompt, "chat-fr")
    assert set(lora_hashes).isdisjoint(wire_hashes(prompt))
    # The base model does not hit the adapter's blocks: its own are stored.
    sub.received.clear()
    await complete(http, sub.url, [*prompt, 1])
    base = await sub.wait_for(lambda: sub.events(BlockStored), "base BlockStored")
    assert [h for e in base for h in e.block_hashes] == wire_hashes(prompt)
    assert base[0].lora_name is None


async def test_eviction_publishes_block_removed(sim: StartSim, http: aiohttp.ClientSession) -> None:
    # 8 usable blocks: B and C after A evict every block of A.
    sub = await sim(num_gpu_blocks=9, max_model_len=128)
    a, b, c = list(range(400, 464)), list(range(1000, 1112)), list(range(2000, 2112))
    for prompt in (a, b, c):
        await complete(http, sub.url, prompt)
    a_hashes = set(wire_hashes(a))
    await sub.wait_for(lambda: a_hashes <= {h for e in sub.events(BlockRemoved) for h in e.block_hashes}, "A removed")
    removed = sub.events(BlockRemoved)
    assert all(e.medium == "GPU" and e.group_idx == 0 and len(e.block_hashes) == 1 for e in removed)
    stored = {h for e in sub.events(BlockStored) for h in e.block_hashes}
    assert {h for e in removed for h in e.block_hashes} <= stored  # only what was announced


async def test_reset_publishes_all_blocks_cleared(sim: StartSim, http: aiohttp.ClientSession) -> None:
    sub = await sim()
    await complete(http, sub.url, list(range(40)))
    await sub.wait_for(lambda: sub.events(BlockStored), "BlockStored")
    async with http.post(sub.url + "/reset_prefix_cache") as r:
        assert await r.json() == {"success": True}
    await sub.wait_for(lambda: sub.events(AllBlocksCleared), "AllBlocksCleared")
    assert isinstance(sub.events()[-1], AllBlocksCleared)


async def test_the_cpu_tier_publishes_with_medium_cpu(sim: StartSim, http: aiohttp.ClientSession) -> None:
    sub = await sim(cpu_offload_tokens=64)  # 4 blocks in host memory
    a, b = list(range(400, 464)), list(range(1000, 1064))  # 4 blocks each
    await complete(http, sub.url, [*a, 1])
    await sub.wait_for(lambda: len([e for e in sub.events(BlockStored) if e.medium == "CPU"]) == 4, "4 CPU stores")
    cpu = [e for e in sub.events(BlockStored) if e.medium == "CPU"]
    assert [e.block_hashes for e in cpu] == [[h] for h in wire_hashes(a)]  # one event per block
    assert [e.token_ids for e in cpu] == [a[i * BS : (i + 1) * BS] for i in range(4)]
    assert [e.parent_block_hash for e in cpu] == [None, *wire_hashes(a)[:3]]
    assert all(e.kv_cache_spec_kind == "full_attention" and e.group_idx == 0 for e in cpu)
    # A second prompt fills the tier again: A's blocks leave it.
    await complete(http, sub.url, [*b, 1])
    await sub.wait_for(
        lambda: [h for e in sub.events(BlockRemoved) if e.medium == "CPU" for h in e.block_hashes] == wire_hashes(a),
        "A evicted from the CPU tier",
    )


async def test_replay_returns_the_buffered_batches_then_the_end_marker(
    sim: StartSim, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context
) -> None:
    sub = await sim(kv_events_config=events_config(buffer_steps=4))
    for i in range(6):  # at least 6 batches (each reset is one)
        await complete(http, sub.url, list(range(1000 * i, 1000 * i + 20)))
        async with http.post(sub.url + "/reset_prefix_cache") as r:
            assert (await r.json())["success"]
    await sub.wait_for(lambda: len(sub.events(AllBlocksCleared)) == 6, "6 resets")
    last = sub.received[-1][1]
    dealer = zctx.socket(zmq.DEALER)
    dealer.connect(local(sub.publisher.replay_endpoint))
    try:

        async def replay(start: int) -> list[tuple[int, bytes]]:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            while True:
                assert await dealer.poll(10_000), "no replay answer"
                empty, topic, seq, payload = await dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert (topic, payload) == (b"", b"")
                    return out
                assert topic == TOPIC.encode()
                out.append((int.from_bytes(seq, "big"), payload))

        # From N on: the batches numbered N.. that are still buffered, byte for byte.
        got = await replay(last - 1)
        assert got == [(n, sub.raw[n]) for n in (last - 1, last)]
        # The buffer keeps the last buffer_steps batches.
        assert [n for n, _ in await replay(0)] == list(range(last - 3, last + 1))
        assert await replay(last + 1) == []
    finally:
        dealer.close(linger=0)
