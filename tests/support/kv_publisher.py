"""A KV-event publisher speaking vLLM's ZMQ protocol, for tests of the router's subscriber:
a PUB socket sending (topic, 8-byte big-endian sequence, msgpack batch) and a ROUTER
socket answering replay requests from its buffer, then the end marker (sequence -1).

Events are plain maps in vLLM's layout (tagged by "type"); batches are arrays
[ts, events, data_parallel_rank]. `publish(..., drop=True)` numbers and buffers a batch
without sending it (a dropped message: a gap); `restart()` starts the numbering again
with an empty buffer, as a restarted engine does.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(
    hashes: list[Any], tokens: list[int], parent: Any = None, block_size: int = 4, medium: str = "GPU"
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def removed(hashes: list[Any], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


class KvPublisher:
    def __init__(self, topic: str = "", rank: int = 0, replay: bool = True) -> None:
        self.topic = topic.encode()
        self.rank = rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = ""
        self._lock = threading.Lock()
        self._buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replay_requests: list[int] = []
        self._running = True
        self._thread: threading.Thread | None = None
        if replay:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            rport = self._router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._thread = threading.Thread(target=self._serve_replay, daemon=True, name="kv-replay")
            self._thread.start()

    def publish(self, *events: dict[str, Any], drop: bool = False, ts: float | None = None) -> int:
        payload = msgspec.msgpack.encode([time.time() if ts is None else ts, list(events), self.rank])
        with self._lock:
            seq = self.seq
            self.seq += 1
            self._buffer.append((seq, payload))
        if not drop:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, payload: bytes) -> None:
        """A payload that is no batch, numbered like the others."""
        with self._lock:
            seq = self.seq
            self.seq += 1
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        with self._lock:
            self.seq = 0
            self._buffer.clear()

    def _serve_replay(self) -> None:
        while self._running:
            if not self._router.poll(50):
                continue
            client, _, start = self._router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                self.replay_requests.append(first)
                batches = [(s, p) for s, p in self._buffer if s >= first]
            for s, p in batches:
                self._router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._router.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.term()
