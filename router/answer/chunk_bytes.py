"""A token chunk in which nothing is decided, relayed on its bytes.

Most chunks of a stream carry one token and nothing else: no finish, no usage, no
logprobs, no role, no prompt ids. The router must see their text and token ids (the answer
so far, for a resume) and give them the answer's id, `object`, `created` and `model`, with
the token ids hidden unless the client asked for them. Parsing each into a dict, rewriting
it and serialising it again was most of the router's CPU per streamed token (a 256-token
stream cost 4x the CPU of an aiohttp pass-through); this reads and rewrites the bytes.

Hand-written instead of a JSON library because a byte scan of the few fields that matter
costs a fraction of a parse plus a dump (the `bench overhead --streams` figures), and the
output must equal what the full path (router/answer/shaper.py) sends byte for byte:

- a leg's chunks are relayed this way only when their header is exactly the canonical JSON
  of the leg's `id`, `object`, `created`, `model` (vLLM's pydantic output is compact, in
  that order), checked on the leg's first chunk and then by a prefix comparison;
- the rest of the chunk must be exactly vLLM 0.32's token chunk (docs/VLLM_WIRE.md):
  completion `"text":<s>,"logprobs":null,"finish_reason":null,"stop_reason":null,
  "prompt_token_ids":null,"token_ids":[<ids>]}]}`, chat `"delta":{"content":<s>},
  "logprobs":null,"finish_reason":null,"token_ids":[<ids>]}]}`. Anything else (a finish,
  usage, logprobs, another field, other spacing, a string that needs re-escaping) returns
  None and takes the full path, which reads every field.

A `"` inside a JSON string is always escaped, so the literal field sequences matched here
cannot occur inside the text.
"""

from __future__ import annotations

import re

import orjson

_COMPLETION_TEXT = b'"text":"'
_COMPLETION_REST = b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
_CHAT_TEXT = b'"delta":{"content":"'
_CHAT_REST = b'},"logprobs":null,"finish_reason":null,'
_IDS = b'"token_ids":['
_END = b"]}]}"
_HIDDEN_IDS_END = b'"token_ids":null}]}\n\n'
# Canonical JSON integers that fit 64 bits, comma-separated, at least one.
_IDS_RE = re.compile(rb"(?:0|[1-9][0-9]{0,17})(?:,(?:0|[1-9][0-9]{0,17}))*")
# Bytes after which a string's raw bytes may differ from orjson's encoding of its value.
_NEEDS_DECODING = re.compile(rb"[\x00-\x1f\\]")


def header(chunk_id: object, obj: object, created: object, model: object) -> bytes | None:
    """`{"id":..,"object":..,"created":..,"model":..,"choices":[{"index":0,` as orjson
    writes it, or None when a value is not of the type vLLM sends."""
    if type(chunk_id) is not str or type(obj) is not str or type(created) is not int or type(model) is not str:
        return None
    return b'{"id":%s,"object":%s,"created":%s,"model":%s,"choices":[{"index":0,' % (
        orjson.dumps(chunk_id),
        orjson.dumps(obj),
        orjson.dumps(created),
        orjson.dumps(model),
    )


def plain_chunks(
    first: dict[str, object], client: tuple[str, str, int, str | None], chat: bool, want_ids: bool
) -> PlainChunks | None:
    """A leg's relay from its first chunk (`client`: the answer's id, object, created, model),
    or None when its header is not of the types vLLM sends."""
    up = header(first.get("id"), first.get("object"), first.get("created"), first.get("model"))
    ours = header(*client)
    if up is None or ours is None:
        return None
    return PlainChunks(up, ours, chat=chat, hide_ids=not want_ids)


def _string_end(b: bytes, i: int) -> int:
    """Index of the `"` closing the JSON string whose content starts at i, or -1."""
    while True:
        q = b.find(b'"', i)
        if q < 0:
            return -1
        k = q - 1
        while b[k] == 0x5C:  # backslashes before it: an odd count escapes it
            k -= 1
        if (q - 1 - k) % 2 == 0:
            return q
        i = q + 1


class PlainChunks:
    """One leg's plain token chunks: recognised, read, and rewritten for the client."""

    __slots__ = ("_client", "_hide_ids", "_rest", "_text_key", "_up", "_up_len")

    def __init__(self, upstream_header: bytes, client_header: bytes, *, chat: bool, hide_ids: bool):
        self._up = upstream_header
        self._up_len = len(upstream_header)
        self._client = b"data: " + client_header
        self._text_key = _CHAT_TEXT if chat else _COMPLETION_TEXT
        self._rest = _CHAT_REST if chat else _COMPLETION_REST
        self._hide_ids = hide_ids

    def relay(self, payload: bytes) -> tuple[bytes, str, list[int]] | None:
        """(the client's SSE event, the chunk's text, its token ids), or None when the chunk
        is not a plain token chunk of this leg (the caller then reads it in full)."""
        n = self._up_len
        key = self._text_key
        if not payload.startswith(self._up) or not payload.endswith(_END) or not payload.startswith(key, n):
            return None
        start = n + len(key)
        q = _string_end(payload, start)
        if q < 0:
            return None
        rest = self._rest
        ids_at = q + 1 + len(rest)
        if not payload.startswith(rest, q + 1) or not payload.startswith(_IDS, ids_at):
            return None
        ids_raw = payload[ids_at + len(_IDS) : -len(_END)]
        if _IDS_RE.fullmatch(ids_raw) is None:
            return None
        raw = payload[start:q]
        if _NEEDS_DECODING.search(raw) is None:
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                return None
            body = payload[n:ids_at] if self._hide_ids else payload[n:]
        else:
            # Escapes: decoded, and written again as orjson writes them (the full path's output).
            try:
                text = orjson.loads(payload[start - 1 : q + 1])
            except orjson.JSONDecodeError:
                return None
            body = key[:-1] + orjson.dumps(text) + payload[q + 1 : ids_at if self._hide_ids else None]
        ids = [int(i) for i in ids_raw.split(b",")]
        if self._hide_ids:
            return self._client + body + _HIDDEN_IDS_END, text, ids
        return self._client + body + b"\n\n", text, ids
