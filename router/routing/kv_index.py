"""An exact index of the KV-cache blocks each engine holds, built from its KV-event stream.

The subscriber (router/fleet/kv_events.py) decodes each engine's batches and hands them to
`KvIndex.apply`; nothing here does I/O.

Keys. An engine's block hashes are its own (seeded per engine), so the router cannot
compute them from a prompt. But every `BlockStored` carries the blocks' token ids and the
hash of the block before them, so the router keys each block by a chain of its own:

    key(block) = blake2b(key(parent) + token ids of the block, 8 bytes)

whose first parent is a root per LoRA adapter (the scheme of llm-d's precise prefix
scorer and Dynamo's radix tree). `prompt_keys` computes the same chain over a prompt's
full blocks, so a prompt's keys are found exactly where an engine stored those tokens.
Per engine the index keeps engine hash -> key (BlockRemoved names engine hashes) and key
-> the tiers holding it (GPU, CPU: vLLM's offloading connector and other secondary media
report a non-GPU `medium`; all of them count as the CPU tier).

What cannot be chained is not indexed: a stored block whose parent the index does not know
(the stream was joined late, or the parent was evicted from the index) is an orphan,
counted and dropped. A block with extra hash inputs (multimodal features, a cache salt) is
keyed with them, so it never matches a plain-token prompt (nor do its descendants): the
router cannot know those inputs for a request. Events of KV-cache groups other than the
first (hybrid models) are skipped: the first group decides prefix hits here.

Data-parallel ranks are kept apart: the index's engines are (backend, rank) pairs (the
batch's `data_parallel_rank`, None as 0), cleared and counted apart; `hits` folds them
into one answer per backend, the best rank's, since the router picks a backend, not a rank.

Memory: at most `max_blocks_per_engine` blocks per (backend, rank); past it the oldest
(least recently stored or re-stored: vLLM re-announces blocks a request reuses) go, and
that engine's view is marked incomplete until it is cleared.

What a policy reads: `RouteQuery.indexed`, which router/dispatch/prompt_index.py fills per
request with `match_request(token_ids, model)` for the engines whose index the snapshot
calls fresh (`BackendView.kv_events_fresh`). The calls themselves:
- `match(token_ids, lora)` -> {backend: KvHit(gpu_tokens, cpu_tokens)}: for each block size
  the engines use, `prompt_keys` then `hits`. A backend absent from the answer has no
  index (no stream, or no block size learnt yet): unknown, not zero.
- or the two steps: `prompt_keys(token_ids, block_size, lora)` and `hits(keys)`;
- `stats(backend)`, `block_size(backend)`: the index's size and completeness per backend.
`hits` counts the longest leading run of the prompt's blocks the engine holds on GPU, then
the run after it held in the CPU tier (what vLLM's connector would load). The counts are of
full blocks; vLLM looks a prompt up over all but its last token, in whole blocks, so what
an engine uses is capped at `prompt_tokens - 1` rounded down to a block (prompt_index.py).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from hashlib import blake2b
from itertools import islice
from typing import Any, ClassVar, NamedTuple, Protocol

GPU, CPU = 1, 2  # tier bits of a key
_GPU_MEDIA = (None, "GPU")
_KEY_BYTES = 8
_ROOT = blake2b(b"cachehit-router kv index root", digest_size=_KEY_BYTES).digest()
# Copying a set-up hasher costs about half of making one (the parameter block).
_HASHER = blake2b(digest_size=_KEY_BYTES)

Key = bytes
EngineHash = bytes | int
Engine = tuple[str, int]  # (backend, data-parallel rank)


# What the index reads of an event batch (router/engine/kv_events_wire.py decodes them):
# protocols, as routing sits beside the engine layer and imports none of it.
class StoredEvent(Protocol):
    kind: ClassVar[str]  # "stored"
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int | None


class RemovedEvent(Protocol):
    kind: ClassVar[str]  # "removed"
    block_hashes: list[EngineHash]
    medium: str | None
    group_idx: int | None


class Batch(Protocol):
    ts: float
    data_parallel_rank: int | None

    @property
    def events(self) -> Sequence[Any]: ...  # StoredEvent | RemovedEvent | a "cleared" event


class KvHit(NamedTuple):
    """Tokens of a prompt an engine holds: its leading GPU run, then the CPU-tier run after it."""

    gpu_tokens: int
    cpu_tokens: int


@dataclass(frozen=True, slots=True)
class PromptKeys:
    block_size: int
    keys: tuple[Key, ...]


@dataclass(frozen=True, slots=True)
class EngineStats:
    blocks: int
    gpu_blocks: int
    cpu_blocks: int
    orphans: int  # stored blocks dropped for an unknown parent (cumulative)
    evicted: int  # blocks dropped for the cap (cumulative)
    complete: bool  # no block dropped for the cap since the last clear
    block_size: int  # 0: not learnt yet


@lru_cache(maxsize=1024)
def _root(lora: str | None) -> Key:
    if not lora:
        return _ROOT
    return blake2b(_ROOT + lora.encode(), digest_size=_KEY_BYTES).digest()


def _chain(key: Key, tokens: bytes) -> Key:
    h = _HASHER.copy()
    h.update(key)
    h.update(tokens)
    return h.digest()


def _pack(token_ids: Sequence[int]) -> bytes | None:
    try:
        return array("I", token_ids).tobytes()
    except (OverflowError, TypeError):  # not token ids the engine could have stored
        return None


def _salted(key: Key, extra: Any) -> Key:
    return blake2b(key + repr(extra).encode(), digest_size=_KEY_BYTES).digest()


class _EngineIndex:
    __slots__ = ("by_hash", "complete", "cpu", "evicted", "gpu", "orphans", "removed_at", "sizes", "tiers")

    def __init__(self) -> None:
        self.by_hash: dict[EngineHash, Key] = {}  # insertion order: oldest first
        self.tiers: dict[Key, int] = {}
        self.gpu = self.cpu = self.orphans = self.evicted = 0
        self.complete = True
        self.sizes: dict[int, int] = {}  # block size -> blocks stored with it
        self.removed_at = 0.0  # when a block last left this view (clock of the KvIndex)

    @property
    def block_size(self) -> int:
        return max(self.sizes, key=self.sizes.__getitem__) if self.sizes else 0

    def set_tiers(self, key: Key, new: int) -> None:
        old = self.tiers.get(key, 0)
        self.gpu += (new & GPU) - (old & GPU)
        self.cpu += ((new & CPU) - (old & CPU)) >> 1
        if new:
            self.tiers[key] = new
        else:
            self.tiers.pop(key, None)

    def drop(self, h: EngineHash) -> None:
        key = self.by_hash.pop(h)
        self.set_tiers(key, 0)

    def clear(self) -> None:
        self.by_hash.clear()
        self.tiers.clear()
        self.gpu = self.cpu = 0
        self.complete = True


class KvIndex:
    def __init__(self, max_blocks_per_engine: int = 262_144, clock: Callable[[], float] = time.monotonic):
        self.max_blocks = max_blocks_per_engine
        # When blocks leave an engine's view (removed, cleared, capped): a placement the
        # router made before then may be gone, one made after it still stands.
        self.clock = clock
        self._engines: dict[Engine, _EngineIndex] = {}
        self.loras: set[str] = set()  # LoRA names engines stored blocks for

    # --- updates (the subscriber) --------------------------------------------------------
    def apply(self, backend: str, batch: Batch) -> None:
        eng = self._engine((backend, batch.data_parallel_rank or 0))
        for ev in batch.events:
            kind = getattr(ev, "kind", "")
            if kind == "stored":
                self._stored(eng, ev)
            elif kind == "removed":
                self._removed(eng, ev)
                eng.removed_at = self.clock()
            elif kind == "cleared":
                eng.clear()
                eng.removed_at = self.clock()

    def clear(self, backend: str) -> None:
        """The engine's cache is gone (it restarted, or its stream cannot be trusted): its
        entries go, every rank's; its cumulative counts stay."""
        for (name, _), eng in self._engines.items():
            if name == backend:
                eng.clear()
                eng.removed_at = self.clock()

    def forget(self, backend: str) -> None:
        """The backend left the fleet."""
        for engine in [e for e in self._engines if e[0] == backend]:
            del self._engines[engine]

    def _engine(self, engine: Engine) -> _EngineIndex:
        eng = self._engines.get(engine)
        if eng is None:
            eng = self._engines[engine] = _EngineIndex()
        return eng

    def _stored(self, eng: _EngineIndex, ev: StoredEvent) -> None:
        if ev.group_idx:
            return
        hashes, size = ev.block_hashes, ev.block_size
        tier = GPU if ev.medium in _GPU_MEDIA else CPU
        if size <= 0 or len(ev.token_ids) != len(hashes) * size:
            # No tokens (a secondary tier's placeholder): it can only add a tier to
            # blocks already known by their engine hash.
            for h in hashes:
                key = eng.by_hash.get(h)
                if key is None:
                    eng.orphans += 1
                else:
                    eng.set_tiers(key, eng.tiers.get(key, 0) | tier)
            return
        if ev.lora_name and ev.lora_name not in self.loras:
            self.loras.add(ev.lora_name)
        parent = ev.parent_block_hash
        key = _root(ev.lora_name) if parent is None else eng.by_hash.get(parent)
        raw = _pack(ev.token_ids)
        if key is None or raw is None:
            eng.orphans += len(hashes)
            return
        extras = ev.extra_keys
        if extras is not None and ev.lora_name:
            # The LoRA name leads each block's extra keys; it is in the chain's root already.
            extras = [None if not e or len(e) <= 1 else tuple(e[1:]) for e in extras]
        step = size * 4
        by_hash = eng.by_hash
        for i, h in enumerate(hashes):
            key = _chain(key, raw[i * step : (i + 1) * step])
            if extras is not None and i < len(extras) and extras[i]:
                key = _salted(key, extras[i])
            old = by_hash.pop(h, None)  # re-stored: it becomes the youngest
            if old is not None and old != key:
                eng.set_tiers(old, 0)
            by_hash[h] = key
            eng.set_tiers(key, eng.tiers.get(key, 0) | tier)
        eng.sizes[size] = eng.sizes.get(size, 0) + len(hashes)
        if len(by_hash) > self.max_blocks:
            # A batch at a time: a dict's front after many deletions is slow to find.
            over = len(by_hash) - self.max_blocks + self.max_blocks // 64
            for victim in list(islice(by_hash, over)):
                eng.drop(victim)
            eng.evicted += over
            eng.complete = False
            eng.removed_at = self.clock()

    def _removed(self, eng: _EngineIndex, ev: RemovedEvent) -> None:
        if ev.group_idx:
            return
        tier = GPU if ev.medium in _GPU_MEDIA else CPU
        for h in ev.block_hashes:
            key = eng.by_hash.get(h)
            if key is None:
                continue  # never indexed (an orphan) or evicted for the cap
            left = eng.tiers.get(key, 0) & ~tier
            if left:
                eng.set_tiers(key, left)
            else:
                eng.drop(h)

    # --- queries (the policies) ------------------------------------------------------------
    @staticmethod
    def prompt_keys(token_ids: Sequence[int], block_size: int, lora: str | None = None) -> PromptKeys:
        """The chained keys of the prompt's full blocks of `block_size` tokens (none for
        token ids no engine could hold)."""
        n = len(token_ids) // block_size if block_size > 0 else 0
        raw = _pack(token_ids[: n * block_size]) if n else None
        if raw is None:
            return PromptKeys(block_size, ())
        key = _root(lora)
        step = block_size * 4
        keys = []
        copy = _HASHER.copy
        for off in range(0, n * step, step):  # _chain, inlined: the per-request cost
            h = copy()
            h.update(key)
            h.update(raw[off : off + step])
            key = h.digest()
            keys.append(key)
        return PromptKeys(block_size, tuple(keys))

    def hits(self, prompt: PromptKeys) -> dict[str, KvHit]:
        """Per backend whose engines use `prompt`'s block size: the prompt's leading blocks
        it holds on GPU, then those after them in the CPU tier, in tokens (best rank)."""
        out: dict[str, KvHit] = {}
        keys, size = prompt.keys, prompt.block_size
        for (name, _), eng in self._engines.items():
            if eng.block_size != size:
                continue
            tiers = eng.tiers
            gpu = 0
            for k in keys:
                if not tiers.get(k, 0) & GPU:
                    break
                gpu += 1
            cpu = 0
            for k in keys[gpu:]:
                if not tiers.get(k, 0) & CPU:
                    break
                cpu += 1
            hit = KvHit(gpu * size, cpu * size)
            best = out.get(name)
            if best is None or (hit[0] + hit[1], hit[0]) > (best[0] + best[1], best[0]):
                out[name] = hit
        return out

    def match(self, token_ids: Sequence[int], lora: str | None = None) -> dict[str, KvHit]:
        """`hits` for every block size the engines use: what a policy asks per request."""
        out: dict[str, KvHit] = {}
        for size in self.block_sizes():
            out.update(self.hits(self.prompt_keys(token_ids, size, lora)))
        return out

    def match_request(self, token_ids: Sequence[int] | None, model: str | None) -> dict[str, KvHit] | None:
        """`match` for a request, None without an index or token ids. `model` is taken for
        a LoRA adapter when engines stored blocks under that name; otherwise the prompt is
        matched as the base model's (an adapter no engine announced a block of yet is
        matched as its base model: its hits may be over-counted until its first block)."""
        if token_ids is None or not self._engines:
            return None
        return self.match(token_ids, model if model in self.loras else None)

    def block_sizes(self) -> set[int]:
        return {s for s in (e.block_size for e in self._engines.values()) if s}

    def last_removal(self, backend: str) -> float:
        """When a block last left the backend's view, any rank (0.0: never)."""
        return self.last_removals().get(backend, 0.0)

    def last_removals(self) -> dict[str, float]:
        """`last_removal` of every backend with an index, in one pass (a snapshot's)."""
        out: dict[str, float] = {}
        for (name, _), e in self._engines.items():
            out[name] = max(out.get(name, 0.0), e.removed_at)
        return out

    def block_size(self, backend: str) -> int:
        """The block size `backend`'s engine stores with (0: not learnt yet)."""
        return max((e.block_size for (n, _), e in self._engines.items() if n == backend), default=0)

    def stats(self, backend: str) -> EngineStats:
        """The backend's figures, summed over its ranks."""
        engines = [e for (n, _), e in self._engines.items() if n == backend]
        return EngineStats(
            blocks=sum(len(e.by_hash) for e in engines),
            gpu_blocks=sum(e.gpu for e in engines),
            cpu_blocks=sum(e.cpu for e in engines),
            orphans=sum(e.orphans for e in engines),
            evicted=sum(e.evicted for e in engines),
            complete=all(e.complete for e in engines),
            block_size=max((e.block_size for e in engines), default=0),
        )

    def backends(self) -> Iterable[str]:
        return {n for n, _ in self._engines}
