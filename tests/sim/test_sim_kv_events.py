"""The simulator's KV cache event stream (engine_launcher/sim/kv_events.py), read with real
ZeroMQ sockets as a router reads vLLM's: a SUB for the live stream, a DEALER for replay."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from engine_launcher.sim import SimEngineHandle
from engine_launcher.sim import kv_events as sim_kv_events
from engine_launcher.sim.cli import build_parser, config_from_args, kv_events_configs
from engine_launcher.sim.kv_cache import hash_blocks
from engine_launcher.sim.kv_event_publisher import ZmqEventPublisher
from engine_launcher.sim.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    encode_batch,
    offset_endpoint_port,
    parse_kv_events_config,
    wire_hash,
)
from support.polling import eventually
from support.requirements import require_module
from support.sim_http import MakeEngine, post

BS = 16
END_SEQ = b"\xff" * 8
TOPIC = "kv@sim"
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def events_config(**kw: Any) -> KVEventsConfig:
    kw.setdefault("enable_kv_cache_events", True)
    kw.setdefault("endpoint", "tcp://*:0")
    kw.setdefault("replay_endpoint", "tcp://*:0")
    kw.setdefault("topic", TOPIC)
    return KVEventsConfig(**kw)


def wire_hashes(tokens: list[int], lora_name: str | None = None) -> list[int]:
    out: list[int] = []
    hash_blocks(tokens, BS, out, lora_name)
    return [wire_hash(h) for h in out]


def local(endpoint: str | None) -> str:
    """A wildcard-bound endpoint as a client on this host dials it."""
    assert endpoint is not None
    return "tcp://127.0.0.1:" + endpoint.rpartition(":")[2]


class Subscriber:
    """The live stream of one engine: (topic, seq, batch) per message, kept in order."""

    def __init__(self, ctx: zmq.asyncio.Context, eng: SimEngineHandle) -> None:
        recorder = eng.engine.kv_events
        assert recorder is not None
        assert isinstance(recorder.publisher, ZmqEventPublisher)  # events enabled: a ZMQ publisher
        self.publisher = recorder.publisher
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.connect(local(self.publisher.endpoint))
        self.url = eng.url
        self.received: list[tuple[bytes, int, KVEventBatch]] = []
        self.raw: dict[int, bytes] = {}

    async def drain(self) -> list[tuple[bytes, int, KVEventBatch]]:
        while await self.sock.poll(0):
            topic, seq, payload = await self.sock.recv_multipart()
            n = int.from_bytes(seq, "big")
            self.raw[n] = payload
            self.received.append((topic, n, _decoder.decode(payload)))
        return self.received

    def events(self, kind: type | None = None) -> list[Any]:
        out = [e for _, _, batch in self.received for e in batch.events]
        return [e for e in out if kind is None or isinstance(e, kind)]

    async def ready(self, http: aiohttp.ClientSession) -> None:
        """Resets until one's AllBlocksCleared arrives: the subscription is then live (a SUB
        misses what is published before it has joined), and the stream is drained."""

        async def cleared() -> bool:
            async with http.post(self.url + "/reset_prefix_cache") as r:
                assert (await r.json())["success"]
            await self.drain()
            return bool(self.events(AllBlocksCleared))

        await eventually(cleared, what="the subscription is live")
        self.received.clear()

    async def wait_for(self, condition: Callable[[], Any], what: str) -> Any:
        async def check() -> Any:
            await self.drain()
            return condition()

        return await eventually(check, what=what)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


# `await sim(**engine_config)`: a started engine with KV events on, its stream subscribed.
StartSim = Callable[..., Awaitable[Subscriber]]


@pytest.fixture
async def sim(
    make_engine: MakeEngine, zctx: zmq.asyncio.Context, http: aiohttp.ClientSession
) -> AsyncIterator[StartSim]:
    subscribers: list[Subscriber] = []

    async def start(**kw: Any) -> Subscriber:
        kw.setdefault("kv_events_config", events_config())
        sub = Subscriber(zctx, await make_engine(**kw))
        subscribers.append(sub)
        await sub.ready(http)
        return sub

    yield start
    for sub in subscribers:  # closed before the test's references go: no socket is leaked
        sub.sock.close(linger=0)


async def complete(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int = 1, **kw: Any
) -> dict[str, Any]:
    status, body = await post(http, url + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **kw})
    assert status == 200, body
    answer: dict[str, Any] = body
    return answer


def stored_tokens(events: list[BlockStored]) -> list[int]:
    return [t for e in events for t in e.token_ids]


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


def test_config_defaults_and_errors_name_the_key() -> None:
    cfg = KVEventsConfig()
    assert (cfg.enable_kv_cache_events, cfg.publisher, cfg.endpoint, cfg.replay_endpoint) == (
        False,
        "null",
        "tcp://*:5557",
        None,
    )
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == (10_000, 100_000, 100_000, "")
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").active
    for text, key in (
        ('{"publisher": "kafka"}', "publisher"),
        ('{"bogus": 1}', "bogus"),
        ('{"buffer_steps": "many"}', "buffer_steps"),
        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
        ('{"endpoint": "http://x:1"}', "endpoint"),
    ):
        with pytest.raises(ValueError, match=rf"kv_events_config\.{key}:"):
            parse_kv_events_config(text)
    with pytest.raises(ValueError, match="JSON object"):
        parse_kv_events_config("[1]")
    args = build_parser().parse_args(
        ["--port", "0", "--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv@a"}']
    )
    parsed = config_from_args(args).kv_events_config
    assert parsed is not None
    cfg = parsed
    assert cfg.active
    assert cfg.topic == "kv@a"
    assert config_from_args(build_parser().parse_args(["--port", "0"])).kv_events_config is None
    # Several engines in one process: ports offset by the engine's index, as DP ranks.
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"


def test_one_events_config_per_port_is_taken_as_given() -> None:
    def configs(*argv: str) -> list:
        return kv_events_configs(build_parser().parse_args(["--port", "0", "--port", "0", *argv]))

    a = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:7001", "replay_endpoint": "tcp://*:7002"}'
    b = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:7101", "replay_endpoint": "tcp://*:7102"}'
    got = configs("--kv-events-config", a, "--kv-events-config", b)
    assert [(c.endpoint, c.replay_endpoint) for c in got] == [
        ("tcp://*:7001", "tcp://*:7002"),
        ("tcp://*:7101", "tcp://*:7102"),
    ]
    # Once: offset per engine, as before.
    once = configs("--kv-events-config", a)
    assert [c.endpoint for c in once] == ["tcp://*:7001", "tcp://*:7002"]
    assert configs() == [None, None]
    three = build_parser().parse_args(["--port", "0", "--kv-events-config", a, "--kv-events-config", b])
    with pytest.raises(ValueError, match=r"--kv-events-config: given 2 times for 1 --port"):
        kv_events_configs(three)


def need_vllm() -> None:
    require_module("vllm")


def test_batches_encode_byte_for_byte_as_vllms() -> None:
    need_vllm()
    from vllm.distributed import kv_events as v

    h = [wire_hash(x) for x in (-5, 1 << 40, -(1 << 62))]

    def events(m: Any) -> list[Any]:
        return [
            m.BlockStored(
                block_hashes=h[:2],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, None],
                group_idx=0,
            ),
            m.BlockStored(
                block_hashes=[h[2]],
                parent_block_hash=h[1],
                token_ids=list(range(16)),
                block_size=16,
                lora_id=3,
                medium="GPU",
                lora_name="chat-fr",
                extra_keys=[("chat-fr",)],
                group_idx=0,
            ),
            m.BlockStored(
                block_hashes=[h[0]],
                parent_block_hash=h[2],
                token_ids=list(range(16)),
                block_size=16,
                lora_id=None,
                medium="CPU",
                lora_name=None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            m.BlockRemoved(block_hashes=[h[0]], medium="GPU", group_idx=0),
            m.BlockRemoved(block_hashes=h, medium="CPU", group_idx=0),
            m.AllBlocksCleared(),
        ]

    ours = encode_batch(KVEventBatch(ts=1712345678.25, events=events(sim_kv_events), data_parallel_rank=0))
    theirs = msgspec.msgpack.encode(v.KVEventBatch(ts=1712345678.25, events=events(v), data_parallel_rank=0))
    assert ours == theirs
    # And vLLM's own decoder reads ours.
    decoded = msgspec.msgpack.Decoder(v.KVEventBatch).decode(ours)
    assert isinstance(decoded.events[1], v.BlockStored)
    assert decoded.events[1].lora_name == "chat-fr"
    assert v.ZmqEventPublisher.END_SEQ == END_SEQ


def sync_replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[list[bytes]]:
    """One replay request, every frame of the answer up to and with the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        frames = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            frames.append(dealer.recv_multipart())
            if frames[-1][2] == END_SEQ:
                return frames
    finally:
        dealer.close(linger=0)


def test_replay_frames_match_vllms_own_publisher() -> None:
    need_vllm()
    from vllm.distributed import kv_events as v

    from engine_launcher.sim.kv_event_publisher import ZmqEventPublisher
    from support.ports import free_port

    def batch(m: Any) -> Any:
        stored = m.BlockStored(
            block_hashes=[7, 8],
            parent_block_hash=None,
            token_ids=list(range(32)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None, None],
            group_idx=0,
        )
        return m.KVEventBatch(ts=1.5, events=[stored, m.AllBlocksCleared()], data_parallel_rank=0)

    theirs = v.ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint=f"tcp://*:{free_port()}", topic=TOPIC)
    ours = ZmqEventPublisher("tcp://*:0", "tcp://*:0", 10, 100, 100, TOPIC)
    ctx = zmq.Context()
    try:
        theirs.publish(batch(v))
        theirs.publish(batch(v))
        ours.publish(encode_batch(batch(sim_kv_events)))
        ours.publish(encode_batch(batch(sim_kv_events)))
        answers = []
        for endpoint in (theirs.get_publisher_config().replay_endpoint, ours.replay_endpoint):
            deadline = time.monotonic() + 10
            while len(frames := sync_replay(ctx, local(endpoint), 1)) < 2:  # published by its thread
                assert time.monotonic() < deadline, "the batches were not published"
            answers.append(frames)
        assert answers[0] == answers[1]
        assert answers[1] == [
            [b"", TOPIC.encode(), (1).to_bytes(8, "big"), encode_batch(batch(sim_kv_events))],
            [b"", b"", END_SEQ, b""],
        ]
    finally:
        theirs.shutdown()
        ours.close()
        ctx.destroy(linger=0)


def free_port_pair(avoid: tuple[int, ...] = ()) -> int:
    """A port p with p + 1 free too (the second engine's), both outside `avoid`."""
    from support.ports import free_port

    while True:
        port = free_port()
        if port + 1 > 65535 or {port, port + 1} & set(avoid):
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
        return port


def test_the_command_line_offsets_each_engines_ports() -> None:
    pub = free_port_pair()
    replay = free_port_pair((pub, pub + 1, pub - 1))
    config = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{pub}", "replay_endpoint": "tcp://*:{replay}"}}'
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_launcher.sim", "--port", "0", "--port", "0", "--kv-events-config", config],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    ctx = zmq.Context()
    try:
        assert proc.stdout is not None
        for _ in range(2):
            assert "sim engine listening" in proc.stdout.readline()
        # Both engines answer replay (with the end marker alone: nothing published yet), the
        # second one port + 1, as vLLM's DP rank 1.
        for rank in (0, 1):
            assert sync_replay(ctx, f"tcp://127.0.0.1:{replay + rank}", 0) == [[b"", b"", END_SEQ, b""]]
    finally:
        ctx.destroy(linger=0)
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_one_ipc_config_gives_each_engine_of_a_process_its_own_socket_files(tmp_path: Path) -> None:
    """The launcher's loopback engines publish on ipc sockets; given once for several
    engines, each engine binds the paths suffixed with its index (vLLM refuses ipc for
    ranks above 0, where the simulator still must not share a socket file)."""
    assert offset_endpoint_port("ipc:///run/kv.events", 1) == "ipc:///run/kv.events_dp1"
    assert offset_endpoint_port("ipc:///run/kv.events", 0) == "ipc:///run/kv.events"
    pub, replay = tmp_path / "kv.events", tmp_path / "kv.replay"
    config = f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{pub}", "replay_endpoint": "ipc://{replay}"}}'
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_launcher.sim", "--port", "0", "--port", "0", "--kv-events-config", config],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    ctx = zmq.Context()
    sockets = [pub, replay, tmp_path / "kv.events_dp1", tmp_path / "kv.replay_dp1"]
    try:
        assert proc.stdout is not None
        for _ in range(2):
            assert "sim engine listening" in proc.stdout.readline()
        # Bound (ipc is a bind endpoint, as in vLLM): the four socket files exist.
        assert all(p.is_socket() for p in sockets)
        for path in (replay, tmp_path / "kv.replay_dp1"):
            assert sync_replay(ctx, f"ipc://{path}", 0) == [[b"", b"", END_SEQ, b""]]
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
    # A clean stop closes the sockets, and ZeroMQ removes their files.
    assert not any(p.exists() for p in sockets)
