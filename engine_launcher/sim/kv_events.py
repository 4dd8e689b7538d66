"""KV cache events of a simulated engine, as vLLM 0.32 publishes them (docs/SIMULATOR.md).

What matches vLLM (vllm/distributed/kv_events.py, vllm/v1/core/block_pool.py, the
OffloadingConnector's events):
- the configuration: `--kv-events-config` JSON with KVEventsConfig's keys and defaults;
  events are off unless enable_kv_cache_events is true and the publisher is "zmq";
- the wire: msgpack of KVEventBatch [ts, events, data_parallel_rank] whose events are maps
  tagged "type": BlockStored, BlockRemoved or AllBlocksCleared, with vLLM's field order and
  omitted defaults, byte for byte; block hashes are unsigned 64-bit ints, as vLLM's with its
  default VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1; the frames and the replay protocol are in
  kv_event_publisher.py;
- what is published: one batch per engine step holding that step's events; a BlockStored
  per run of newly cached full blocks (prompt and generated tokens alike) with their token
  ids, the parent block's hash, block_size, medium "GPU", group_idx 0, the LoRA adapter's
  name, id and extra keys; a BlockRemoved per evicted block; AllBlocksCleared on a prefix
  cache reset; for the CPU tier, one BlockStored per stored block and one BlockRemoved per
  store's evictions, medium "CPU", in the shape of the connector's self-describing events.
What differs: a reset's AllBlocksCleared is published at once (vLLM waits for its next
step); a block computed twice at once (a duplicate) is not announced, where vLLM announces
both copies; several engines in one process are separate engines: each publishes with
data_parallel_rank 0, on the configured ports offset by its index as vLLM offsets DP ranks
(an ipc:// path gets a "_dp<index>" suffix, where vLLM refuses ipc for ranks above 0).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

log = logging.getLogger("engine_launcher.sim")

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
PUBLISHERS = ("null", "zmq")
_HASH_MASK = (1 << 64) - 1
_FULL_ATTENTION = "full_attention"


# --- configuration ----------------------------------------------------------------------


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: same keys, defaults and meaning."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def validate(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher: Input should be 'null' or 'zmq', got {self.publisher!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, key) < 0:
                raise ValueError(f"kv_events_config.{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"kv_events_config.{key}: must be a tcp://, ipc:// or inproc:// address, got {value!r}"
                )

    def for_rank(self, rank: int) -> KVEventsConfig:
        """The config of the rank-th engine of a process: vLLM's per-DP-rank offsets."""
        return dataclasses.replace(
            self,
            endpoint=offset_endpoint_port(self.endpoint, rank) or self.endpoint,
            replay_endpoint=offset_endpoint_port(self.replay_endpoint, rank),
        )


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}
_TYPE_WORDS = {bool: "a valid boolean", int: "a valid integer", str: "a valid string"}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """`--kv-events-config` JSON as vLLM takes it; errors name the offending key."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_events_config: not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError("kv_events_config: expected a JSON object")
    for key, value in raw.items():
        types = _FIELD_TYPES.get(key)
        if types is None:
            raise ValueError(f"kv_events_config.{key}: Unexpected keyword argument")
        # JSON true is not an integer here (nor 1 a boolean).
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"kv_events_config.{key}: Input should be {_TYPE_WORDS[types[0]]}, got {value!r}")
    cfg = KVEventsConfig(**raw)
    cfg.validate()
    return cfg


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """tcp: port + rank (port 0 stays 0); inproc and ipc: a "_dp<rank>" suffix; rank 0:
    unchanged. (vLLM 0.32 refuses an ipc endpoint for a rank above 0; the simulator gives
    each engine of a process its own socket file instead.)"""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return endpoint


# --- the wire: vLLM's structs, field for field ----------------------------------------


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Each event is a map tagged with its class name under "type"."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def wire_hash(block_hash: int) -> int:
    """The simulator's (signed) chained hash as vLLM's unsigned 64-bit int."""
    return block_hash & _HASH_MASK


# --- the recorder: cache changes in, one batch per step out ---------------------------


class _Request(Protocol):
    all_ids: list[int]
    block_hashes: list[int]
    lora_name: str | None


class _Publisher(Protocol):
    def publish(self, payload: bytes) -> None: ...

    def close(self) -> None: ...


class KVEventRecorder:
    """Turns the KV cache's and the CPU tier's changes into vLLM's events, and publishes the
    events of each engine step as one batch (`flush`, called by the engine loop)."""

    def __init__(
        self,
        publisher: _Publisher,
        block_size: int,
        requests: Mapping[str, _Request],
        lora_names: Sequence[str] = (),
        data_parallel_rank: int = 0,
    ) -> None:
        self.publisher = publisher
        self.data_parallel_rank = data_parallel_rank
        self.block_size = block_size
        self._requests = requests
        self._pending: list[KVCacheEvent] = []
        # vLLM numbers adapters from 1 in the order they are loaded (static ones first).
        self._lora_ids: dict[str, int] = {name: i for i, name in enumerate(lora_names, 1)}

    def _lora(self, name: str | None) -> int | None:
        if name is None:
            return None
        return self._lora_ids.setdefault(name, len(self._lora_ids) + 1)

    @staticmethod
    def _runs(indices: list[int]) -> list[tuple[int, int]]:
        """Contiguous [start, stop) block index runs: one event's blocks share one parent."""
        runs: list[tuple[int, int]] = []
        for i in indices:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        return runs

    def _stored(self, req: _Request, start: int, stop: int, medium: str) -> BlockStored:
        bs = self.block_size
        hashes = req.block_hashes
        lora = req.lora_name
        gpu = medium == MEDIUM_GPU
        return BlockStored(
            block_hashes=[wire_hash(h) for h in hashes[start:stop]],
            parent_block_hash=wire_hash(hashes[start - 1]) if start else None,
            token_ids=req.all_ids[start * bs : stop * bs],
            block_size=bs,
            lora_id=self._lora(lora),
            medium=medium,
            lora_name=lora,
            # The GPU pool lists each block's extra keys (the adapter's name); the
            # connector leaves them out.
            extra_keys=[(lora,) if lora is not None else None] * (stop - start) if gpu else None,
            group_idx=0,
            kv_cache_spec_kind=None if gpu else _FULL_ATTENTION,
        )

    # CacheListener (kv_cache.py)

    def gpu_stored(self, request_id: str, block_indices: list[int]) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        for start, stop in self._runs(block_indices):
            self._pending.append(self._stored(req, start, stop, MEDIUM_GPU))

    def gpu_removed(self, block_hash: int) -> None:
        self._pending.append(BlockRemoved(block_hashes=[wire_hash(block_hash)], medium=MEDIUM_GPU, group_idx=0))

    def gpu_cleared(self) -> None:
        self._pending.append(AllBlocksCleared())
        # A reset may come while the engine is idle, with no step to carry it.
        self.flush()

    # TierListener (cpu_tier.py)

    def cpu_stored(self, request_id: str | None, block_indices: list[int]) -> None:
        req = self._requests.get(request_id) if request_id is not None else None
        if req is None:
            return
        # The connector publishes one event per offloaded chunk (one block by default).
        for i in block_indices:
            self._pending.append(self._stored(req, i, i + 1, MEDIUM_CPU))

    def cpu_removed(self, block_hashes: list[int]) -> None:
        self._pending.append(
            BlockRemoved(block_hashes=[wire_hash(h) for h in block_hashes], medium=MEDIUM_CPU, group_idx=0)
        )

    # the engine's side

    def flush(self) -> None:
        if not self._pending:
            return
        batch = KVEventBatch(ts=time.time(), events=self._pending, data_parallel_rank=self.data_parallel_rank)
        self._pending = []
        self.publisher.publish(encode_batch(batch))

    def close(self) -> None:
        self.flush()
        self.publisher.close()


class _Listened(Protocol):
    listener: Any


class _Engine(Protocol):
    @property
    def config(self) -> Any: ...
    @property
    def kv(self) -> _Listened: ...
    @property
    def cpu(self) -> _Listened: ...
    @property
    def requests(self) -> Mapping[str, _Request]: ...


def attach(engine: _Engine) -> KVEventRecorder | None:
    """Start publishing an engine's KV events when its config asks for them."""
    cfg: KVEventsConfig | None = engine.config.kv_events_config
    if cfg is None or not cfg.active:
        return None
    # zmq is needed only with events on.
    from .kv_event_publisher import ZmqEventPublisher

    publisher = ZmqEventPublisher(
        cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic
    )
    recorder = KVEventRecorder(
        publisher,
        engine.config.block_size,
        engine.requests,
        list(engine.config.lora_modules),
        engine.config.data_parallel_rank,
    )
    engine.kv.listener = recorder
    engine.cpu.listener = recorder
    return recorder
