"""Where this router sent which prompt prefixes: an approximate radix tree.

The probe strategy uses it to rank engines and to know what an engine still computing a
prompt will hold; the prefix_tree strategy routes by it. It is per router replica and
only ever a guess: the engines' own caches are the truth (the probe race asks them).
"""

from __future__ import annotations

import time
from collections import OrderedDict

_RECENT_PROMPTS = 16


class PrefixMemory:
    """Which backend was sent which prompt prefixes: an approximate radix tree.

    The SGLang gateway and vllm-router keep a character radix tree per backend. This keeps
    chained hashes of fixed-size text chunks instead (like vLLM's block hashes), which
    gives the same longest-prefix answer at `chunk_chars` granularity at a fraction of the
    cost in Python. Bounded: least recently used (hash, backend) entries are evicted.
    Each entry keeps when the router last sent that prefix there: an engine's report of
    what it holds is the truth, except about a prompt the router sent it so recently that
    the engine may still be computing it (`expected_hits(..., sent_within_s=...)`).
    """

    def __init__(self, chunk_chars: int = 64, max_entries: int = 1_000_000):
        self.chunk_chars = chunk_chars
        self.max_entries = max_entries
        self._owners: dict[int, dict[str, float]] = {}  # chunk hash -> backend -> when sent
        self._lru: OrderedDict[tuple[int, str], None] = OrderedDict()
        # The last few prompts' hashes: one request asks about its prompt several times
        # (plan, fallback, feedback), and hashing a long prompt is most of each answer's cost.
        self._recent: OrderedDict[str, list[int]] = OrderedDict()

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
        if len(self._recent) > _RECENT_PROMPTS:
            self._recent.popitem(last=False)
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

    def insert(self, hashes: list[int], backend: str, now: float | None = None) -> None:
        sent = time.monotonic() if now is None else now
        for h in hashes:
            self._owners.setdefault(h, {})[backend] = sent
            key = (h, backend)
            self._lru[key] = None
            self._lru.move_to_end(key)
        while len(self._lru) > self.max_entries:
            (h, b), _ = self._lru.popitem(last=False)
            owners = self._owners.get(h)
            if owners is not None:
                owners.pop(b, None)
                if not owners:
                    del self._owners[h]

    def placement(self, text: str) -> tuple[float, dict[str, float]]:
        """The share of `text`'s chunks whose longest known prefix the router sent, and when
        it last sent it to each backend holding it (monotonic)."""
        hashes = self.chunk_hashes(text)
        if not hashes:
            return 0.0, {}
        matched, holders, sent_at = self._match(hashes)
        return matched / len(hashes), {b: sent_at[b] for b in holders}

    def expected_hits(
        self, text: str, prompt_tokens: float, sent_within_s: float | None = None, now: float | None = None
    ) -> dict[str, float]:
        """Prompt tokens each backend is expected to hold of `text`: the share of the
        prompt whose longest known prefix the router sent there (rounded down to chunks);
        with `sent_within_s`, only where it was sent that recently."""
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
        return {name: share for name in holders}
