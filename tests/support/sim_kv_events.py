"""The simulator's KV event stream as a router reads it: a SUB on the live stream
(`Subscriber`), a DEALER for replay (`sync_replay`), and the expected block hashes. The
`zctx` and `sim` fixtures built on these are in sim/conftest.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from engine_launcher.sim import SimEngineHandle
from engine_launcher.sim.kv_cache import hash_blocks
from engine_launcher.sim.kv_event_publisher import ZmqEventPublisher
from engine_launcher.sim.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, KVEventsConfig, wire_hash
from support.polling import eventually
from support.sim_http import post

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
        misses what is published before it has joined). Then the stream is drained up to the
        last reset sent, so none still on its way lands among a test's own events: on a
        fresh engine each reset is one batch, numbered from 0, and batches arrive in order."""
        sent = 0

        async def cleared() -> bool:
            nonlocal sent
            async with http.post(self.url + "/reset_prefix_cache") as r:
                assert (await r.json())["success"]
            sent += 1
            await self.drain()
            return bool(self.events(AllBlocksCleared))

        await eventually(cleared, what="the subscription is live")
        await self.wait_for(lambda: self.received[-1][1] >= sent - 1, "the last reset's batch")
        self.received.clear()

    async def wait_for(self, condition: Callable[[], Any], what: str) -> Any:
        async def check() -> Any:
            await self.drain()
            return condition()

        return await eventually(check, what=what)


# `await sim(**engine_config)`: a started engine with KV events on, its stream subscribed.
StartSim = Callable[..., Awaitable[Subscriber]]


async def complete(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int = 1, **kw: Any
) -> dict[str, Any]:
    status, body = await post(http, url + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **kw})
    assert status == 200, body
    answer: dict[str, Any] = body
    return answer


def stored_tokens(events: list[BlockStored]) -> list[int]:
    return [t for e in events for t in e.token_ids]


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
