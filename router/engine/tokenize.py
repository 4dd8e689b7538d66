"""The engine's own token ids of a prompt, for the KV-event index.

vLLM keys its prefix cache by the token ids it computes, chat template included, and its
KV events carry those ids; a router-side guess (characters per token, another
tokenizer, a template rendered differently) would match nothing. So the router asks an
engine serving the model: `POST /tokenize` with the same fields vLLM's chat and
completion requests render with (messages, tools, chat template and its arguments,
generation prompt, special tokens). A prompt given as token ids needs no call.

Cost: one small request to an engine's API server (no GPU work), about a millisecond on a
local network, paid only by the policies that read the index; answers are kept in a
bounded LRU keyed by the exact tokenize body, so a retried or repeated prompt costs
nothing. The LRU is bounded in token ids too (`max_cached_ids`), kept as 4-byte integers:
a 4 MiB prompt is ~2M ids, which as a tuple of Python ints costs 72 MB.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any

import orjson

from router.engine.client import UpstreamClient
from router.engine.errors import PROTOCOL, UpstreamError

# Fields of a chat request that change what its template renders (vLLM's
# TokenizeChatRequest reads the same names).
_CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
_COMPLETION_FIELDS = ("prompt", "add_special_tokens")


def tokenize_body(endpoint_is_chat: bool, body: dict[str, Any], model: str | None) -> dict[str, Any] | None:
    """The /tokenize body rendering `body`'s prompt as the engine will, or None when the
    prompt is not one text (a batch, token ids: the caller has the ids already)."""
    fields = _CHAT_FIELDS if endpoint_is_chat else _COMPLETION_FIELDS
    out = {k: body[k] for k in fields if k in body}
    if endpoint_is_chat:
        if not isinstance(out.get("messages"), list):
            return None
    elif not isinstance(out.get("prompt"), str):
        return None
    if model:
        out["model"] = model
    return out


def token_ids_of(answer: dict[str, Any], backend: str) -> tuple[int, ...]:
    tokens = answer.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise UpstreamError(backend, PROTOCOL, "/tokenize answered without a list of token ids")
    return tuple(tokens)


class PromptTokenizer:
    """Token ids of prompts from the engines' /tokenize, with a bounded LRU of answers."""

    def __init__(self, client: UpstreamClient, max_entries: int = 4096, max_cached_ids: int = 16 * 2**20) -> None:
        self.client = client
        self.max_entries = max_entries
        self.max_cached_ids = max_cached_ids  # 64 MiB of ids at most
        self._cache: OrderedDict[bytes, array[int]] = OrderedDict()
        self._cached_ids = 0
        self.calls = 0  # /tokenize requests sent (the cache missed)
        self.hits = 0

    async def token_ids(
        self, backend: str, base_url: str, body: dict[str, Any], *, api_key: str = "", deadline: float | None = None
    ) -> tuple[int, ...]:
        key = hashlib.blake2b(orjson.dumps(body, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return tuple(found)
        self.calls += 1
        answer = await self.client.post_json(
            backend, base_url, "/tokenize", body, api_key=api_key, total_deadline=deadline
        )
        ids = token_ids_of(answer, backend)
        del answer  # its list of ints is as large as the tuple
        if len(ids) <= self.max_cached_ids // 4:  # a prompt larger than that is not kept
            self._cache[key] = array("I", ids)
            self._cached_ids += len(ids)
            while len(self._cache) > self.max_entries or self._cached_ids > self.max_cached_ids:
                self._cached_ids -= len(self._cache.popitem(last=False)[1])
        return ids
