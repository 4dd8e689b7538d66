"""The ZeroMQ side of the KV event stream: vLLM 0.32's PUB + ROUTER replay protocol.

Frames, as vLLM's ZmqEventPublisher sends them:
- PUB: (topic, sequence number as 8 bytes big-endian unsigned, msgpack payload), one
  message per published batch; sequence numbers start at 0 and grow by one per batch;
- ROUTER (replay): a request is (identity, b"", start sequence as 8 bytes big-endian), as a
  DEALER sending (b"", start) or a REQ sending (start) produce it; the answer is one
  (identity, b"", topic, sequence, payload) per buffered batch from `start` on, then the end
  marker (identity, b"", b"", -1 as 8 bytes big-endian signed, b""). The buffer keeps the
  last `buffer_steps` batches.

A thread owns the PUB and ROUTER sockets, as in vLLM, so a replay answer never runs on the
simulator's event loop. The loop hands it encoded batches through an inproc PUSH/PULL pair
(never blocking: a full queue drops the batch, where vLLM's scheduler would wait).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections import deque

import zmq

log = logging.getLogger("engine_launcher.sim")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SHUTDOWN_TIMEOUT_S = 1.0

_inbox_ids = itertools.count()


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or an ipc/inproc address is bound, anything else is
    connected to (e.g. a proxy that gathers several engines' streams)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind and return the bound address (a tcp port 0 becomes the port the OS chose)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(f"kv events: cannot bind {endpoint}: {e}") from e
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) and last else endpoint


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        buffer_steps: int,
        hwm: int,
        max_queue_size: int,
        topic: str,
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.dropped = 0
        self._closed = False
        sockets: list[zmq.Socket[bytes]] = []
        try:
            self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
            sockets.append(self._pub)
            self._pub.set_hwm(hwm)
            if is_bind_endpoint(endpoint):
                self.endpoint = _bind(self._pub, endpoint)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self._replay: zmq.Socket[bytes] | None = None
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                sockets.append(self._replay)
                # A whole answer fits the peer's queue, and a vanished peer is an error
                # rather than a silent drop.
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 1)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
            inbox = f"inproc://sim-kv-events-{next(_inbox_ids)}"
            self._pull: zmq.Socket[bytes] = self._ctx.socket(zmq.PULL)
            sockets.append(self._pull)
            self._pull.bind(inbox)
            self._push: zmq.Socket[bytes] = self._ctx.socket(zmq.PUSH)
            sockets.append(self._push)
            self._push.setsockopt(zmq.SNDHWM, max_queue_size)
            self._push.connect(inbox)
        except BaseException:
            for s in sockets:
                s.close(linger=0)
            raise
        self._thread = threading.Thread(target=self._serve, name="sim-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s, replay on %s", self.endpoint, self.replay_endpoint)

    def publish(self, payload: bytes) -> None:
        """Queue one encoded batch (called from the event loop only; never blocks)."""
        if self._closed:
            return
        try:
            self._push.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV events: publisher queue full, %d batches dropped", self.dropped)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # An empty message is the stop sentinel: no encoded batch is empty.
        try:
            self._push.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV events: publisher queue full at shutdown")
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        self._push.close(linger=0)
        if self._thread.is_alive():
            log.warning("KV events: publisher thread did not stop")
            return
        for s in (self._pub, self._replay, self._pull):
            if s is not None:
                s.close(linger=0)
        # ZeroMQ unlinks a bound ipc socket's file only once its I/O thread gets to it,
        # which a process about to exit may never let happen.
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None and endpoint.startswith("ipc://") and is_bind_endpoint(endpoint):
                with contextlib.suppress(OSError):
                    os.unlink(endpoint[len("ipc://") :])

    # --- the publisher thread ----------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        seq = 0
        while True:
            ready = dict(poller.poll())
            if self._replay is not None and self._replay in ready:
                try:
                    self._answer_replay(self._replay)
                except zmq.ZMQError as e:
                    log.warning("KV events: replay answer failed: %s", e)
            if self._pull in ready:
                payload = self._pull.recv()
                if not payload:
                    return
                try:
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                except zmq.ZMQError as e:  # the batch stays replayable under its number
                    log.warning("KV events: publishing batch %d failed: %s", seq, e)
                self._buffer.append((seq, payload))
                seq += 1

    def _answer_replay(self, sock: zmq.Socket[bytes]) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: invalid replay request of %d frames", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        sock.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
