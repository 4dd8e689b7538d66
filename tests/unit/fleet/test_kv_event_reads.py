"""When the KV-event streams are read (router/fleet/kv_event_reads.py), on the running event
loop with real file descriptors: a pipe stands for each ZMQ socket, a byte written to it for
the signal of a batch (read back when the socket's events are asked, as ZMQ does)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from router.fleet.kv_event_reads import StreamReads
from support.polling import eventually


class PipeStream:
    """A stream's socket: batches queue up, and each one signals the descriptor."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.queued = 0
        self.wakes = 0
        self.read = 0

    def publish(self, batches: int = 1) -> None:
        self.queued += batches
        os.write(self.write_fd, b"x" * batches)

    def has_batches(self) -> bool:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass  # the signal is read back, as ZMQ's events are
        return self.queued > 0

    def wake(self) -> None:  # the stream's reader reads every queued batch at once
        self.wakes += 1
        self.has_batches()
        self.read += self.queued
        self.queued = 0

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


@pytest.fixture
async def streams() -> AsyncIterator[list[PipeStream]]:
    made = [PipeStream(), PipeStream()]
    yield made
    for s in made:
        s.close()


def tick(reads: StreamReads) -> None:
    """The shared tick, now (its timer is an hour away in these tests)."""
    assert reads._tick is not None
    reads._tick.cancel()
    reads._on_tick()


async def turns_of_the_loop(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)  # each turn polls the descriptors without blocking


async def test_without_an_interval_every_batch_is_read_as_it_arrives(streams: list[PipeStream]) -> None:
    reads = StreamReads(0.0)
    a, b = streams
    for s in streams:
        reads.watch(s.read_fd, s.has_batches, s.wake)
    a.publish()
    await eventually(lambda: a.read == 1, what="a's batch read")
    b.publish()
    await eventually(lambda: b.read == 1, what="b's batch read")
    a.publish()
    await eventually(lambda: a.read == 2, what="a's second batch read")
    assert not reads.ticking
    for s in streams:
        reads.unwatch(s.read_fd)


async def test_while_events_flow_every_stream_is_read_on_one_tick_then_watched_again(
    streams: list[PipeStream],
) -> None:
    reads = StreamReads(3600.0)
    a, b = streams
    for s in streams:
        reads.watch(s.read_fd, s.has_batches, s.wake)
    a.publish()  # the first batch after a quiet stretch: read at once
    await eventually(lambda: a.read == 1, what="a's first batch read")
    assert reads.ticking
    a.publish(3)
    b.publish(2)
    await turns_of_the_loop()
    assert (a.wakes, b.wakes) == (1, 0)  # nothing watched until the tick
    tick(reads)
    assert (a.read, b.read) == (4, 2)
    assert (a.wakes, b.wakes) == (2, 1)  # one wake-up each for all their batches
    assert reads.ticking  # events flowed: the next tick is due
    tick(reads)  # finds none: the sockets are watched again
    assert not reads.ticking
    assert (a.wakes, b.wakes) == (2, 1)
    b.publish()
    await eventually(lambda: b.read == 3, what="b's batch after the quiet tick read at once")
    for s in streams:
        reads.unwatch(s.read_fd)
    assert not reads.ticking  # the last stream gone: no tick left behind


async def test_a_batch_published_between_the_quiet_tick_and_the_watch_is_not_lost(
    streams: list[PipeStream],
) -> None:
    reads = StreamReads(3600.0)
    a, _ = streams
    reads.watch(a.read_fd, lambda: a.has_batches(), a.wake)  # looked up at each call: replaced below
    a.publish()
    await eventually(lambda: a.read == 1, what="a's first batch read")
    asked = a.has_batches

    def publish_right_after_asking() -> bool:
        found = asked()
        a.publish()  # after the tick looked, before the descriptor is watched again
        return found

    a.has_batches = publish_right_after_asking  # type: ignore[method-assign]
    tick(reads)
    assert not reads.ticking
    a.has_batches = asked  # type: ignore[method-assign]
    await eventually(lambda: a.read == 2, what="the batch published while the tick looked")
    reads.unwatch(a.read_fd)


async def test_a_socket_that_cannot_be_asked_wakes_its_reader(streams: list[PipeStream]) -> None:
    reads = StreamReads(3600.0)
    a, b = streams

    def broken() -> bool:
        raise OSError("socket closed")

    reads.watch(a.read_fd, broken, a.wake)
    reads.watch(b.read_fd, b.has_batches, b.wake)
    b.publish()
    await eventually(lambda: b.read == 1, what="b's first batch read")
    tick(reads)
    assert a.wakes == 1  # its reader meets the error and subscribes again
    for s in streams:
        reads.unwatch(s.read_fd)
