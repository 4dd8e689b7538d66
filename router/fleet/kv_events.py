"""The engines' KV-event streams, feeding the block index (router/routing/kv_index.py).

One task per backend with a `kv_events_endpoint`: a ZMQ SUB socket on the engine's PUB
endpoint, subscribed to its topic, and, with a `kv_events_replay_endpoint`, a DEALER to
its replay socket (wire format: router/engine/kv_events_wire.py). Backends come and go
with the fleet (router/fleet/membership.py calls `subscribe` / `unsubscribe` for every
source: configuration, started engines, admin API, discovery).

Sequence numbers keep the index exact:
- on subscribing, the index of that engine is rebuilt from the replay socket (from 0:
  whatever the engine still buffers);
- a gap (a batch's number jumps past the next expected one: the PUB socket dropped
  batches) asks the replay socket for the missing ones and applies them before the live
  batch. Batches the engine no longer buffers (or no replay socket) cannot be known: the
  engine's entries are cleared, so the index may miss blocks but never claims a block an
  unseen removal took away;
- a restart (the number goes back, or the engine answers its health checks again after it
  was down) clears the engine's entries and replays from 0.
The SUB socket's high-water mark bounds what waits in memory (past it ZMQ drops, which
is a gap). A payload that does not decode is counted and logged once; the loop goes on.

Freshness (`fresh`, `BackendView.kv_events_fresh`): the stream is in sync (a replay or a
live batch since subscribing, no gap pending), its last batch arrived less than
`stale_after_s` after the engine published it, and it has not been silent that long while
the engine works (router legs in flight or scraped running requests: an idle engine
publishes nothing, and its index is still exact).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from router.config.schema import BackendConfig, KvEventsConfig
from router.engine.kv_events_wire import DecodeError, decode_batch, decode_seq, parse_replay_reply, replay_request
from router.fleet.event_sequences import follow_sequences
from router.fleet.registry import BackendRegistry, BackendState
from router.routing.kv_index import KvIndex

log = logging.getLogger("cachehit_router.kv_events")

_HWM = 10_000  # batches a socket holds for the router before ZMQ drops (a gap, replayed)
_POLL_MS = 250  # how often a quiet stream looks at its engine's health
_POLLIN = int(zmq.POLLIN)
_DRAIN = 64  # batches read at most between two turns of the event loop
_REPLAY_TIMEOUT_MS = 5_000  # between two replies of the replay socket
_RETRY_S = 1.0  # after a socket error, before subscribing again


@dataclass
class KvStream:
    """One backend's subscription: its state and the figures its gauges read."""

    name: str
    config: BackendConfig
    expected: int | None = None  # the next sequence number to apply
    last_live: int | None = None  # the last sequence number seen on the PUB stream
    synced: bool = False
    lag_s: float = 0.0  # the last live batch's age when it arrived
    last_recv: float = 0.0  # monotonic
    busy: bool = False
    busy_since: float = 0.0
    seen_healthy: bool = False
    was_down: bool = False
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    restarts: int = 0
    lost: int = 0  # times a stretch of batches could not be replayed (entries cleared)
    decode_errors: int = 0
    skipped_events: int = 0  # events of a type this router does not know
    task: asyncio.Task[Any] | None = field(default=None, repr=False)


class KvEvents:
    def __init__(
        self,
        index: KvIndex,
        registry: BackendRegistry,
        config: KvEventsConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.index = index
        self.registry = registry
        self.config = config
        self.clock, self.wall = clock, wall
        self.streams: dict[str, KvStream] = {}
        self._ctx: zmq.asyncio.Context | None = None

    # --- membership ------------------------------------------------------------------------
    def subscribe(self, state: BackendState) -> KvStream | None:
        """Start following `state`'s stream (None: it has no endpoint)."""
        c = state.config
        if not c.kv_events_endpoint:
            return None
        self.unsubscribe(c.name)
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        st = self.streams[c.name] = KvStream(c.name, c)
        st.task = asyncio.create_task(self._run(st), name=f"kv-events-{c.name}")
        log.info("backend %s: following its KV events at %s", c.name, c.kv_events_endpoint)
        return st

    def unsubscribe(self, name: str) -> None:
        st = self.streams.pop(name, None)
        if st is not None and st.task is not None:
            st.task.cancel()
        self.index.forget(name)

    async def close(self) -> None:
        tasks = [st.task for st in self.streams.values() if st.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.streams.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def fresh(self, state: BackendState, now: float) -> bool:
        """Whether `state`'s index entries may be trusted now (see the module's docstring)."""
        st = self.streams.get(state.config.name)
        if st is None or not st.synced or st.lag_s > self.config.stale_after_s:
            return False
        busy = state.inflight > 0 or state.running > 0
        return not busy or now - max(st.last_recv, st.busy_since) <= self.config.stale_after_s

    # --- one stream ------------------------------------------------------------------------
    async def _run(self, st: KvStream) -> None:
        while True:
            try:
                await self._session(st)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a socket error: subscribe again, never end the task
                log.warning(
                    "backend %s: KV-event stream failed (%s: %s); subscribing again", st.name, type(e).__name__, e
                )
            st.synced = False
            await asyncio.sleep(_RETRY_S)

    async def _session(self, st: KvStream) -> None:
        assert self._ctx is not None
        c = st.config
        topic = c.kv_events_topic.encode()
        # A plain socket whose file descriptor the loop watches: pyzmq's awaited poll cost a
        # future, a reader registered and removed, and their callbacks per wake-up, and a
        # busy engine publishes a batch every step.
        sub: zmq.Socket[bytes] = zmq.Context.shadow(self._ctx.underlying).socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, _HWM)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(c.kv_events_endpoint)
        loop = asyncio.get_running_loop()
        fd = sub.fileno()
        readable = asyncio.Event()
        loop.add_reader(fd, readable.set)
        # A quiet stream looks at its engine's health every _POLL_MS: one repeating timer,
        # where a timeout around each wait cost a Timeout and a timer handle per batch.
        beat: list[asyncio.TimerHandle] = []

        def heartbeat() -> None:
            readable.set()
            beat[0] = loop.call_later(_POLL_MS / 1000, heartbeat)

        beat.append(loop.call_later(_POLL_MS / 1000, heartbeat))
        try:
            st.expected, st.last_live = None, None
            if c.kv_events_replay_endpoint:
                await self._resync(st)
            while True:
                if self._tick(st):
                    log.info("backend %s: answers again after it was down; KV index rebuilt", st.name)
                    await self._resync(st)
                # ZMQ's descriptor signals that its events changed, edge-triggered: whether a
                # batch waits is in zmq.EVENTS, read after clearing the flag (a batch arriving
                # between the two sets it again).
                readable.clear()
                if not int(sub.getsockopt(zmq.EVENTS)) & _POLLIN:  # ints: a Flag's & is Python code
                    await readable.wait()
                    continue
                # Queued batches are read in one turn of the loop (`python -m bench
                # kv-events-cpu`: 100 -> 45 us a batch at 5,000 a second).
                for _ in range(_DRAIN):
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self._received(st, topic, frames)
                else:
                    await asyncio.sleep(0)  # a backlog: let requests run between reads
        finally:
            beat[0].cancel()
            loop.remove_reader(fd)
            sub.close(linger=0)

    async def _received(self, st: KvStream, topic: bytes, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[0] != topic:
            return  # another topic sharing the prefix
        try:
            seq = decode_seq(frames[1])
        except DecodeError as e:
            self._decode_error(st, e)
            return
        await self._live(st, seq, frames[2])

    def _tick(self, st: KvStream) -> bool:
        """Follow the engine's health and load; True when it came back after being down."""
        state = self.registry.states.get(st.name)
        if state is None:
            return False
        busy = state.inflight > 0 or state.running > 0
        if busy and not st.busy:
            st.busy_since = self.clock()
        st.busy = busy
        if not state.healthy:
            st.was_down = st.seen_healthy
            return False
        st.seen_healthy = True
        back, st.was_down = st.was_down, False
        return back

    async def _live(self, st: KvStream, seq: int, payload: bytes) -> None:
        st.last_recv = self.clock()
        restarted = st.last_live is not None and seq <= st.last_live
        if restarted:
            st.restarts += 1
            log.info(
                "backend %s: KV-event sequence went back (%d after %d): engine restarted", st.name, seq, st.last_live
            )
            self.index.clear(st.name)
            state = self.registry.states.get(st.name)
            if state is not None:
                state.sequences.cleared()
            st.expected = 0
        st.last_live = seq
        if st.expected is None:  # no replay socket: the stream starts here
            st.expected = seq
        if seq > st.expected:
            if st.synced and not restarted:
                st.gaps += 1
            await self._catch_up(st, seq)
        if seq < st.expected:
            return  # a replay brought it already
        batch = self._apply(st, payload, live=True)
        st.expected = seq + 1
        st.synced = True
        if batch is not None:
            st.lag_s = max(self.wall() - batch, 0.0)

    async def _catch_up(self, st: KvStream, upto: int) -> None:
        """Batches expected..upto-1, from the replay socket; what it cannot give is lost."""
        assert st.expected is not None
        if st.config.kv_events_replay_endpoint:
            await self._replay(st, live=True)  # the batches the PUB socket dropped: recent
        if st.expected < upto:
            st.lost += 1
            log.warning(
                "backend %s: KV-event batches %d..%d cannot be replayed; its index entries are cleared",
                st.name,
                st.expected,
                upto - 1,
            )
            self.index.clear(st.name)
            st.expected = upto

    async def _resync(self, st: KvStream) -> None:
        """Rebuild the engine's entries from everything its replay socket buffers."""
        self.index.clear(st.name)
        st.expected, st.last_live, st.synced = 0, None, False
        if await self._replay(st):
            st.synced = True
            st.last_recv = self.clock()

    async def _replay(self, st: KvStream, live: bool = False) -> bool:
        """Apply the batches the replay socket has from `st.expected` on; True once it
        answered them all (its end marker). `live`: they fill a gap in the live stream (what
        the engine runs now), not its history."""
        assert self._ctx is not None
        assert st.expected is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, _HWM)
        dealer.connect(st.config.kv_events_replay_endpoint)
        st.replays += 1
        first = True
        try:
            await dealer.send_multipart(replay_request(st.expected))
            while True:
                if not await dealer.poll(_REPLAY_TIMEOUT_MS):
                    log.warning("backend %s: the KV-event replay socket did not answer", st.name)
                    return False
                try:
                    reply = parse_replay_reply(await dealer.recv_multipart())
                except DecodeError as e:
                    self._decode_error(st, e)
                    return False
                if reply is None:
                    return True
                seq, payload = reply
                if first and seq > st.expected and st.expected > 0:
                    # The engine no longer buffers the start: what is missing is lost.
                    st.lost += 1
                    self.index.clear(st.name)
                first = False
                if seq >= st.expected:
                    self._apply(st, payload, live)
                    st.expected = seq + 1
        finally:
            dealer.close(linger=0)

    def _apply(self, st: KvStream, payload: bytes, live: bool = False) -> float | None:
        """Decode and index one batch; its publication time, None if it did not decode. A
        live batch is also what the engine runs now (router/fleet/event_sequences.py); a
        replayed one is history."""
        try:
            batch, skipped = decode_batch(payload)
            rank = st.config.data_parallel_rank
            if rank >= 0 and batch.data_parallel_rank is not None and batch.data_parallel_rank != rank:
                # Another DP rank's cache (an endpoint not offset by the rank): not this backend's.
                raise ValueError(f"a batch of DP rank {batch.data_parallel_rank}, not {rank}: check kv_events_endpoint")
            self.index.apply(st.name, batch)
            if live:
                state = self.registry.states.get(st.name)
                if state is not None and state.follows_sequences:  # sequences a prefill could stall
                    follow_sequences(state.sequences, batch.events, self.clock())
        except (DecodeError, ValueError, TypeError) as e:
            self._decode_error(st, e)
            return None
        st.batches += 1
        if skipped:
            if not st.skipped_events:
                log.warning("backend %s: KV events of an unknown type skipped (a newer vLLM?)", st.name)
            st.skipped_events += skipped
        return batch.ts

    def _decode_error(self, st: KvStream, e: Exception) -> None:
        if not st.decode_errors:
            log.warning("backend %s: a KV-event message did not decode (%s); counted from now on", st.name, e)
        st.decode_errors += 1
