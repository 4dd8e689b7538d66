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
from collections.abc import Callable
from itertools import repeat
from operator import itemgetter, sub

import orjson

# A canonical JSON integer that fits 64 bits.
_ID = rb"(?:0|[1-9][0-9]{0,17})"
# The rest of a token chunk after its header: group 1 the text as JSON string content
# (escapes allowed, raw control characters not), group 2 the token ids (at least one).
# Possessive: no backtracking into the text (the alternation per character was a third of
# the match's time).
_TEXT = rb'((?:[^"\\\x00-\x1f]++|\\.)*+)'
_IDS = rb"\[(" + _ID + rb"(?:," + _ID + rb")*)\]\}\]\}"
_COMPLETION_OPEN = b'"text":"'
_COMPLETION_MID = b'","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":'
_CHAT_OPEN = b'"delta":{"content":"'
_CHAT_MID = b'"},"logprobs":null,"finish_reason":null,"token_ids":'
_COMPLETION = re.compile(re.escape(_COMPLETION_OPEN) + _TEXT + re.escape(_COMPLETION_MID) + _IDS, re.DOTALL)
_CHAT = re.compile(re.escape(_CHAT_OPEN) + _TEXT + re.escape(_CHAT_MID) + _IDS, re.DOTALL)
_HIDDEN_IDS_END = b"null}]}\n\n"

# A run of token chunks relayed in one pass (`PlainChunks.relay_run`): only the escapes
# orjson writes the same way (so the text is relayed as it came), one token id a chunk (so
# a run of n chunks is n tokens).
_SAFE_TEXT = rb'(?:[^"\\\x00-\x1f]++|\\[\\"nrtbf])*+'


def _token_body(chat: bool) -> bytes:
    """A token chunk past its header, three groups: all of it (the client's event when it
    asked for the ids), its text (the event when not; the answer's text), its one id."""
    opening, mid = (_CHAT_OPEN, _CHAT_MID) if chat else (_COMPLETION_OPEN, _COMPLETION_MID)
    return b"(" + re.escape(opening) + b"(" + _SAFE_TEXT + b")" + re.escape(mid) + rb"\[(" + _ID + rb")\]\}\]\})"


# A run is checked with patterns compiled once: its chunks' headers are compared with the
# leg's by slicing (one set of n slices), and the rest of each chunk is a line the pattern
# matches. A pattern with the header in it was compiled per leg, as every answer's id is
# its own (~250 us of CPU a streamed request); replacing the header in the run by a marker
# searched the 136-byte needle anew for each of its occurrences (~100 us a 256-chunk run).
# Split on it, a run of n chunks without their headers, a line each, leaves 4n + 1 pieces:
# each chunk's three groups, and empty pieces between them (anything else there is a chunk
# that is not plain).
_RUN_SPLIT = {chat: re.compile(b"(?m)^" + _token_body(chat) + b"$\n?").split for chat in (False, True)}

# A leg's whole chunks of plain token events matched on the chunked body's bytes
# (`PlainChunks.relay_chunked`): chunk size, the header (any bytes of the leg's header's
# length: compared after), then the chunk as a run's; compiled once per (chat, header
# length). Split on it, n chunks leave 6n + 1 pieces.
_CHUNKED: dict[tuple[bool, int], Callable[[bytes], list[bytes]]] = {}
_CHUNKED_MAX = 64  # header lengths kept compiled (models' names differ, ids' lengths not)


def _chunked_split(chat: bool, header_len: int) -> Callable[[bytes], list[bytes]]:
    split = _CHUNKED.get((chat, header_len))
    if split is None:
        if len(_CHUNKED) >= _CHUNKED_MAX:
            _CHUNKED.clear()
        head = rb"([0-9a-fA-F]{1,8})\r\ndata: (.{%d})" % header_len
        split = _CHUNKED[chat, header_len] = re.compile(head + _token_body(chat) + b"\n\n\r\n", re.DOTALL).split
    return split


def read_compact(block: bytes) -> tuple[str, list[int]]:
    """The text and token ids of a run `relay_run` or `relay_chunked` relayed (its text as
    JSON string content, NUL, its ids: what the answer keeps of it until it is read)."""
    raw, _, ids = block.partition(b"\x00")
    text: str = orjson.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode()
    return text, list(map(int, ids.split(b",")))


def _compact(texts: list[bytes], ids: list[bytes]) -> bytes | None:
    """`read_compact`'s block, or None when the text is not UTF-8."""
    text = b"".join(texts)
    return text + b"\x00" + b",".join(ids) if _utf8(text) else None


def _utf8(text: bytes) -> bool:
    """As the full path's parse would have it: invalid UTF-8 is an unreadable chunk."""
    if text.isascii():
        return True
    try:
        text.decode()
    except UnicodeDecodeError:
        return False
    return True


def looks_plain(payload: bytes) -> bool:
    """A hint, on a few byte searches: the chunk may be a plain token chunk (no finish, not a
    usage chunk, no prompt ids). `PlainChunks.relay_run` checks it; the hint only keeps the
    chunks before and after a run out of it."""
    return payload.endswith(b"]}]}") and _NO_FINISH in payload and _PROMPT_IDS not in payload


_NO_FINISH = b'"finish_reason":null,'
_PROMPT_IDS = b'"prompt_token_ids":['


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


class PlainChunks:
    """One leg's plain token chunks: recognised, read, and rewritten for the client."""

    __slots__ = (
        "_chunk_extra",
        "_chunked",
        "_client",
        "_head",
        "_hide_ids",
        "_match",
        "_past_head",
        "_run",
        "_run_end",
        "_run_open",
        "_run_sep",
        "_up",
        "_up_len",
        "_up_only",
        "chat",
    )

    def __init__(self, upstream_header: bytes, client_header: bytes, *, chat: bool, hide_ids: bool):
        self._up = upstream_header
        self._up_len = len(upstream_header)
        self._up_only = {upstream_header}
        self._head = itemgetter(slice(None, self._up_len))
        self._past_head = itemgetter(slice(self._up_len, None))
        self._client = b"data: " + client_header
        self._match = (_CHAT if chat else _COMPLETION).fullmatch
        self._hide_ids = hide_ids
        self.chat = chat
        # A run's client events: what they keep of its chunks joined between these.
        opening, mid = (_CHAT_OPEN, _CHAT_MID) if chat else (_COMPLETION_OPEN, _COMPLETION_MID)
        if hide_ids:
            self._run_open = self._client + opening
            self._run_end = mid + _HIDDEN_IDS_END
        else:
            self._run_open = self._client
            self._run_end = b"\n\n"
        self._run_sep = self._run_end + self._run_open
        self._run = _RUN_SPLIT[chat]
        self._chunked = _chunked_split(chat, self._up_len)
        self._chunk_extra = {6 + self._up_len + 2}  # a chunk's size less its part past the header

    def relay_chunked(self, data: bytes) -> tuple[bytes, bytes, int, int] | None:
        """`relay_run` on a read of the leg's chunked body (router/engine/chunked.py): (the
        client's SSE events, the run's text and ids for `read_compact`, its chunks, the bytes
        of `data` they were) for the whole chunks `data` begins with, when all are plain token
        chunks of this leg, each its own HTTP chunk (as uvicorn writes them); else None (the
        read is read the usual way). One split does the de-chunking, the SSE framing and
        the relay's match at once: each of those three over the same bytes cost about as
        much as the split (~0.7 us a chunk together)."""
        pieces = self._chunked(data)
        # [before, size, header, chunk past it, text, id, between, ..., the rest of the read]
        if len(pieces) == 1 or pieces[0] or any(pieces[6:-1:6]):
            return None
        headers = pieces[2::6]
        if headers.count(self._up) != len(headers):
            return None
        rests = pieces[3::6]
        if set(map(sub, map(int, pieces[1::6], repeat(16)), map(len, rests))) != self._chunk_extra:
            return None  # a size that is not its chunk's: the general rules say what is wrong
        texts = pieces[4::6]
        relayed = self._events(texts, rests, pieces[5::6])
        return None if relayed is None else (*relayed, len(texts), len(data) - len(pieces[-1]))

    def relay_run(self, payloads: list[bytes]) -> tuple[bytes, bytes] | None:
        """(the client's SSE events, the run's text and ids for `read_compact`) for chunks
        that are all plain, one token id each, their text escaped as orjson writes it; else
        None (the caller relays them one by one). Slices, one regular expression split over
        the run and joins: per chunk, nothing runs in Python (one `relay` a chunk cost ~2.6
        us here, most of a streamed token's CPU past the pass-through's)."""
        n = len(payloads)
        if n == 1:  # a paced stream's: no joins
            payload = payloads[0]
            if not payload.startswith(self._up):
                return None
            parts = self._run(payload[self._up_len :])
            if len(parts) != 5 or parts[0] or parts[4] or not _utf8(text := parts[2]):
                return None
            return self._run_open + (text if self._hide_ids else parts[1]) + self._run_end, text + b"\x00" + parts[3]
        else:
            if set(map(self._head, payloads)) != self._up_only:
                return None
            block = b"\n".join(map(self._past_head, payloads))
        parts = self._run(block)
        if len(parts) != 4 * n + 1 or any(parts[::4]):
            return None
        return self._events(parts[2::4], parts[1::4], parts[3::4])

    def _events(self, texts: list[bytes], wholes: list[bytes], ids: list[bytes]) -> tuple[bytes, bytes] | None:
        """A run's chunks past their headers (whole), their texts and ids -> (the client's
        SSE events, the run's text and ids for `read_compact`); None when the text is not
        UTF-8."""
        compact = _compact(texts, ids)
        if compact is None:
            return None
        return self._run_open + self._run_sep.join(texts if self._hide_ids else wholes) + self._run_end, compact

    def relay(self, payload: bytes) -> tuple[bytes, str, list[int]] | None:
        """(the client's SSE event, the chunk's text, its token ids), or None when the chunk
        is not a plain token chunk of this leg (the caller then reads it in full)."""
        # One regular expression checks and splits the whole chunk: a few C calls a chunk,
        # where Python-level scanning cost more than orjson's parse and dump together.
        if not payload.startswith(self._up) or (m := self._match(payload, self._up_len)) is None:
            return None
        raw = m.group(1)
        ids_at = m.start(2) - 1  # the `[`
        n = self._up_len
        if b"\\" not in raw:
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                return None
            body = payload[n:ids_at] if self._hide_ids else payload[n:]
        else:
            # Escapes: decoded, and written again as orjson writes them (the full path's output).
            start, end = m.span(1)
            try:
                text = orjson.loads(payload[start - 1 : end + 1])
            except orjson.JSONDecodeError:
                return None
            body = payload[n : start - 1] + orjson.dumps(text) + payload[end + 1 : ids_at if self._hide_ids else None]
        ids_raw = m.group(2)
        ids = [int(ids_raw)] if b"," not in ids_raw else [int(i) for i in ids_raw.split(b",")]
        if self._hide_ids:
            return self._client + body + _HIDDEN_IDS_END, text, ids
        return self._client + body + b"\n\n", text, ids


_FINISH = b'"finish_reason":'
_COMPLETION_TOKENS = b'"completion_tokens":'


def unary_answer_problem(body: bytes, max_tokens: int | None) -> str | None:
    """What is wrong with an engine's non-streamed answer forwarded on its bytes, or None: no
    choice finished (a broken engine's empty answer), or more tokens than max_tokens. A byte
    scan, not a parse: the answer is forwarded as it came (as above, a key cannot occur
    inside a JSON string)."""
    i = body.find(_FINISH)
    while i >= 0 and body.startswith(b"null", i + len(_FINISH)):
        i = body.find(_FINISH, i + len(_FINISH))
    if i < 0:
        return "the answer has no finish_reason"
    if max_tokens is not None and (j := body.find(_COMPLETION_TOKENS)) >= 0:
        digits = body[j + len(_COMPLETION_TOKENS) :][:20].split(b",", 1)[0].split(b"}", 1)[0].strip()
        if digits.isdigit() and int(digits) > max_tokens:
            return f"the engine sent more tokens ({int(digits)}) than max_tokens ({max_tokens})"
    return None
