"""Where this router sent which prompt prefixes: an approximate radix tree.

The probe strategy uses it to rank engines and to know what an engine still computing a
prompt will hold; the prefix_tree strategy routes by it. It is per router replica and
only ever a guess: the engines' own caches are the truth (the probe race asks them).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping

_RECENT_PROMPTS = 16
# What one (chunk, backend) entry costs in memory, all its structures together (measured:
# `python -m bench prefix-memory` prints it); the byte budget is turned into entries with it.
ENTRY_BYTES = 420
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class PrefixMemory:
    """Which backend was sent which prompt prefixes: an approximate radix tree.

    The SGLang gateway and vllm-router keep a character radix tree per backend. This keeps
    chained hashes of fixed-size text chunks instead (like vLLM's block hashes), which
    gives the same longest-prefix answer at `chunk_chars` granularity at a fraction of the
    cost in Python. Each entry keeps when the router last sent that prefix there: an
    engine's report of what it holds is the truth, except about a prompt the router sent it
    so recently that the engine may still be computing it (`expected_hits(...,
    sent_within_s=...)`).

    Bounded in bytes (`max_bytes`, about `ENTRY_BYTES` an entry) and shared fairly between
    tenants: each (chunk, backend) entry belongs to the tenant that last sent it, each
    tenant's entries are a least-recently-used list, and past the budget the entries go
    from the tenant holding the most (with equal shares, the one most over its share). So
    a tenant sending huge unique prompts evicts its own entries, not those of tenants
    under their share; alone, it may use the whole budget.
    """

    def __init__(self, chunk_chars: int = 64, max_bytes: int = DEFAULT_MAX_BYTES):
        self.chunk_chars = chunk_chars
        self.max_bytes = max_bytes
        self.max_entries = max(max_bytes // ENTRY_BYTES, 1)
        self._owners: dict[int, dict[str, float]] = {}  # chunk hash -> backend -> when sent
        self._tenant_of: dict[tuple[int, str], str] = {}  # (hash, backend) -> the tenant that sent it last
        self._lru: dict[str, OrderedDict[tuple[int, str], None]] = {}  # tenant -> its entries, oldest first
        # The last few prompts' hashes: one request asks about its prompt several times
        # (plan, fallback, feedback), and hashing a long prompt is most of each answer's cost.
        # Bounded in hashes too (a few huge prompts must not hold more than the memory).
        self._recent: OrderedDict[str, list[int]] = OrderedDict()
        self._recent_hashes = 0

    def __len__(self) -> int:
        """Entries held: (chunk, backend) pairs."""
        return len(self._tenant_of)

    def entries_of(self, tenant: str) -> int:
        lru = self._lru.get(tenant)
        return 0 if lru is None else len(lru)

    @property
    def approx_bytes(self) -> int:
        return len(self._tenant_of) * ENTRY_BYTES

    def chunk_hashes(self, text: str) -> list[int]:
        found = self._recent.get(text)
        if found is not None:
            return found
        c = self.chunk_chars
        out, h = [], 0
        for i in range(0, len(text) - c + 1, c):
            h = hash((h, text[i : i + c]))
            out.append(h)
        self._recent[text] = out
        self._recent_hashes += len(out)
        while len(self._recent) > _RECENT_PROMPTS or (
            self._recent_hashes > self.max_entries // 8 and len(self._recent) > 1
        ):
            self._recent_hashes -= len(self._recent.popitem(last=False)[1])
        return out

    def match(self, hashes: list[int]) -> tuple[int, set[str]]:
        """Longest matched prefix (in chunks) and the backends holding it."""
        best_len, best, _ = self._match(hashes)
        return best_len, best

    def _match(self, hashes: list[int]) -> tuple[int, set[str], dict[str, float]]:
        alive: set[str] | None = None
        best_len, best, owners_at = 0, set(), {}
        for i, h in enumerate(hashes):
            owners = self._owners.get(h)
            if not owners:
                break
            alive = set(owners) if alive is None else alive & owners.keys()
            if not alive:
                break
            best_len, best, owners_at = i + 1, alive, owners
        return best_len, best, owners_at

    def insert(self, hashes: list[int], backend: str, now: float | None = None, tenant: str = "") -> None:
        sent = time.monotonic() if now is None else now
        lru = self._lru.get(tenant)
        if lru is None:
            lru = self._lru[tenant] = OrderedDict()
        # A prompt longer than the tenant's share keeps its beginning: a prefix is only
        # found from its first chunk, so evicting the start would make the rest useless.
        share = max(self.max_entries // len(self._lru), 1)
        tenant_of, all_lru = self._tenant_of, self._lru
        for h in hashes[:share]:
            self._owners.setdefault(h, {})[backend] = sent
            key = (h, backend)
            before = tenant_of.get(key)
            if before is not None and before != tenant:
                other = all_lru[before]
                del other[key]
                if not other:
                    del all_lru[before]
            tenant_of[key] = tenant
            lru[key] = None
            lru.move_to_end(key)
        self._evict()

    def resize(self, max_bytes: int) -> None:
        """A new budget (a reload), applied at once."""
        self.max_bytes = max_bytes
        self.max_entries = max(max_bytes // ENTRY_BYTES, 1)
        self._evict()

    def _evict(self) -> None:
        over = len(self._tenant_of) - self.max_entries
        while over > 0:
            share = self.max_entries // len(self._lru)
            tenant, lru = max(self._lru.items(), key=lambda kv: len(kv[1]))
            for _ in range(max(min(over, len(lru) - share), 1)):
                key, _ = lru.popitem(last=False)
                del self._tenant_of[key]
                owners = self._owners.get(key[0])
                if owners is not None:
                    owners.pop(key[1], None)
                    if not owners:
                        del self._owners[key[0]]
                over -= 1
            if not lru:
                del self._lru[tenant]

    def placement(self, text: str) -> tuple[float, dict[str, float]]:
        """The share of `text`'s chunks whose longest known prefix the router sent, and when
        it last sent it to each backend holding it (monotonic)."""
        hashes = self.chunk_hashes(text)
        if not hashes:
            return 0.0, {}
        matched, holders, sent_at = self._match(hashes)
        return matched / len(hashes), {b: sent_at[b] for b in holders}

    def expected_hits(
        self,
        text: str,
        prompt_tokens: float,
        sent_within_s: float | None = None,
        now: float | None = None,
        sent_since: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Prompt tokens each backend is expected to hold of `text`: the share of the
        prompt whose longest known prefix the router sent there (rounded down to chunks);
        with `sent_within_s`, only where it was sent that recently; with `sent_since`, only
        the backends named there, where it was sent at or after their time (monotonic)."""
        hashes = self.chunk_hashes(text)
        if not hashes or prompt_tokens <= 0:
            return {}
        matched, holders, sent_at = self._match(hashes)
        if not matched:
            return {}
        share = prompt_tokens * matched / len(hashes)
        if sent_within_s is not None:
            t = time.monotonic() if now is None else now
            holders = {b for b in holders if t - sent_at[b] <= sent_within_s}
        if sent_since is not None:
            holders = {b for b in holders if b in sent_since and sent_at[b] >= sent_since[b]}
        return {name: share for name in holders}
