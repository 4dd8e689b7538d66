"""What the KV-event index says of one request's prompt, put on its `RouteQuery`.

Only for a policy that reads the index (`reads_index`). The prompt's engine token ids come
from the query (a resume, a prompt of token ids) or from an engine's /tokenize
(router/engine/tokenize.py); they are matched against the index
(router/routing/kv_index.py) and the query carries, for each engine whose index is fresh
in this snapshot, the tokens it holds. A prompt that cannot be tokenized (a batch, an
engine error) is planned without the index: the policies then fall back on what they
would do without events.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from router.engine.errors import UpstreamError
from router.engine.tokenize import PromptTokenizer, tokenize_body
from router.routing.kv_index import KvHit, KvIndex
from router.routing.planning import RouteQuery
from router.routing.snapshot import ClusterSnapshot

log = logging.getLogger("cachehit_router.dispatch")


class PromptIndex:
    """Fills `RouteQuery.indexed` (and the exact prompt length) from the KV-event index."""

    def __init__(
        self,
        index: KvIndex,
        tokenizer: PromptTokenizer,
        url_of: Callable[[str], tuple[str, str] | None],
    ) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.url_of = url_of  # backend name -> (base URL, API key), None once it left the fleet
        self.failures = 0  # prompts planned without the index because /tokenize failed

    async def token_ids(
        self, query: RouteQuery, chat: bool, body: dict[str, Any], snap: ClusterSnapshot, deadline: float | None
    ) -> tuple[int, ...] | None:
        if query.token_ids is not None:
            return query.token_ids
        tb = tokenize_body(chat, body, query.model)
        if tb is None:
            return None
        # Any engine serving the model tokenizes alike; the least busy answers soonest.
        engines = sorted(snap.decoders(query.model), key=lambda b: (b.inflight, b.name))
        for b in engines[:2]:
            where = self.url_of(b.name)
            if where is None:
                continue
            try:
                return await self.tokenizer.token_ids(b.name, where[0], tb, api_key=where[1], deadline=deadline)
            except UpstreamError as e:
                log.info("prompt not tokenized on %s (%s: %s): planned without the KV index", b.name, e.kind, e.detail)
        self.failures += 1
        return None

    def _usable(self, hit: KvHit, n: int, name: str) -> int:
        """What of `hit` engine `name` uses for a prompt of `n` tokens: vLLM looks a prompt up
        over its first n - 1 tokens (the last one is computed for its logits) and in whole
        blocks, so a prompt of exactly k blocks has its last block computed again."""
        cap = max(n - 1, 0)
        block = self.index.block_size(name)
        if block > 0:
            cap -= cap % block
        return min(hit.gpu_tokens + hit.cpu_tokens, cap)

    async def annotate(
        self, query: RouteQuery, chat: bool, body: dict[str, Any], snap: ClusterSnapshot, deadline: float | None
    ) -> RouteQuery:
        """`query` with the index's figures for the engines it speaks for now."""
        fresh = [b.name for b in snap.backends if b.kv_events_fresh]
        if not fresh:
            return query
        ids = await self.token_ids(query, chat, body, snap, deadline)
        if ids is None:
            return query
        # An adapter's blocks are keyed by its name (vLLM's extra keys), even before the
        # index has seen one of them; the base model's by nothing.
        found = (
            self.index.match(ids, query.adapter) if query.adapter else self.index.match_request(ids, query.model)
        ) or {}
        indexed = {name: float(self._usable(found[name], len(ids), name)) if name in found else 0.0 for name in fresh}
        return replace(query, token_ids=ids, prompt_tokens=len(ids), indexed=indexed)
