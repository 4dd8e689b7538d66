"""A deterministic tokenizer and token generator for the simulator.

Vocabulary (fixed, same in every process and every run):

- id 0: ``<unk>`` (never produced), id 1: ``<|eos|>`` (the EOS token; its text is empty,
  as a special token skipped in the output);
- ids 2..257: one token per byte value (id = byte + 2), the fallback for any text;
- ids 258..: words from `WORDS`, each twice: ``"word"`` then ``" word"`` (leading space);
- the rest, up to 128,256 ids (Llama 3's vocabulary size): placeholders ``<|id_N|>``, so
  prompts of token ids from a real tokenizer are accepted.

Encoding splits text with `_PIECE_RE` into pieces (an optional space followed by a run of
ASCII letters, a single digit, a single whitespace or other character); a piece that is a
vocabulary word becomes its word token, anything else becomes its UTF-8 bytes. The split is
greedy left to right, so **two texts that share a prefix share every token except possibly
the one covering the end of the shorter text** (for example ``"the cat sat"`` and
``"the cat sang"`` share ``["the", " cat"]``); that is the property prefix caching needs.
Decoding concatenates pieces and decodes UTF-8, so ``decode(encode(t)) == t`` for any text.

No BOS token is added (documented difference: Llama's tokenizer adds one).

Chat messages are rendered with a fixed template before encoding (`render_chat`):
``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n`` (the generation prompt).

Generated tokens are words with a leading space (so output text reads as words), chosen by a
64-bit mix of (engine seed, request seed, prompt token ids, output position): the same
request always produces the same output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

UNK_ID = 0
EOS_ID = 1
_BYTE_BASE = 2
_WORD_BASE = _BYTE_BASE + 256

WORDS: tuple[str, ...] = tuple(
    [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
        "it",
        "be",
        "this",
        "are",
        "or",
        "an",
        "which",
        "his",
        "had",
        "not",
        "have",
        "but",
        "were",
        "her",
        "they",
        "has",
        "one",
        "their",
        "all",
        "been",
        "new",
        "also",
        "more",
        "first",
        "two",
        "can",
        "after",
        "who",
        "would",
        "other",
        "into",
        "its",
        "time",
        "when",
        "some",
        "only",
        "over",
        "most",
        "out",
        "she",
        "about",
        "up",
        "many",
        "may",
        "such",
        "these",
        "than",
        "then",
        "them",
        "there",
        "them",
        "well",
        "made",
        "years",
        "through",
        "before",
        "three",
        "while",
        "where",
        "back",
        "state",
        "world",
        "city",
        "people",
        "during",
        "used",
        "well",
        "under",
        "between",
        "year",
        "same",
        "part",
        "most",
        "system",
        "water",
        "house",
        "school",
        "river",
        "found",
        "known",
        "first",
        "life",
        "work",
        "group",
        "place",
        "long",
        "south",
        "north",
        "east",
        "west",
        "great",
        "small",
        "little",
        "large",
        "high",
        "low",
        "right",
        "left",
        "early",
        "late",
        "good",
        "best",
        "just",
        "very",
        "still",
        "even",
        "never",
        "always",
        "again",
        "again",
        "here",
        "now",
        "down",
        "each",
        "both",
        "few",
        "much",
        "own",
        "since",
        "around",
        "because",
        "made",
        "across",
        "against",
        "along",
        "among",
        "another",
        "away",
        "being",
        "below",
        "beyond",
        "call",
        "come",
        "could",
        "day",
        "does",
        "done",
        "end",
        "every",
        "face",
        "fact",
        "far",
        "feel",
        "find",
        "give",
        "go",
        "hand",
        "head",
        "help",
        "home",
        "keep",
        "kind",
        "know",
        "last",
        "leave",
        "let",
        "line",
        "look",
        "make",
        "man",
        "mean",
        "might",
        "move",
        "name",
        "need",
        "next",
        "night",
        "number",
        "old",
        "open",
        "order",
        "page",
        "paper",
        "play",
        "point",
        "power",
        "put",
        "read",
        "real",
        "run",
        "say",
        "see",
        "seem",
        "set",
        "show",
        "side",
        "sound",
        "start",
        "stay",
        "story",
        "study",
        "take",
        "tell",
        "thing",
        "think",
        "turn",
        "use",
        "want",
        "way",
        "week",
        "while",
        "woman",
        "word",
        "work",
        "write",
        "light",
        "cloud",
        "stone",
        "river",
        "garden",
        "window",
        "table",
        "music",
        "letter",
        "market",
        "forest",
        "bridge",
        "harbor",
        "engine",
        "signal",
        "token",
        "cache",
        "block",
        "model",
        "layer",
        "query",
        "value",
        "router",
        "stream",
        "batch",
        "prefix",
    ]
)
# Keep first occurrences only, in order, so ids are stable.
WORDS = tuple(dict.fromkeys(WORDS))

_PIECE_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]|\s|[^\sA-Za-z0-9]")

_id_to_piece: list[bytes] = [b"", b""] + [bytes([b]) for b in range(256)]
_piece_to_id: dict[str, int] = {}
for _w in WORDS:
    for _p in (_w, " " + _w):
        _piece_to_id[_p] = len(_id_to_piece)
        _id_to_piece.append(_p.encode())
NUM_BUILT_IN = len(_id_to_piece)
# The id space is Llama 3's (128,256 ids) so token-id prompts taken from a real tokenizer
# are accepted; ids past the built-in vocabulary decode to a placeholder `<|id_N|>`
# (never produced by encode or by the generator).
VOCAB_SIZE = 128256
# Generated text uses the space-prefixed words only.
_GEN_IDS: tuple[int, ...] = tuple(_piece_to_id[" " + w] for w in WORDS)

_MASK64 = (1 << 64) - 1


def encode(text: str) -> list[int]:
    out: list[int] = []
    lookup = _piece_to_id.get
    for piece in _PIECE_RE.findall(text):
        tid = lookup(piece)
        if tid is not None:
            out.append(tid)
        else:
            out.extend(b + _BYTE_BASE for b in piece.encode())
    return out


# Text of each built-in token, decoded once (token_text is on the per-token path).
_id_to_text: list[str] = [p.decode("utf-8", errors="replace") for p in _id_to_piece]


def _piece(t: int) -> bytes:
    if 0 <= t < NUM_BUILT_IN:
        return _id_to_piece[t]
    if NUM_BUILT_IN <= t < VOCAB_SIZE:
        return b"<|id_%d|>" % t
    return b""


def decode(token_ids: Sequence[int]) -> str:
    """Text of a token sequence; special tokens (EOS, UNK) decode to nothing."""
    return b"".join(map(_piece, token_ids)).decode("utf-8", errors="replace")


def token_text(token_id: int) -> str:
    """Text of one token (what vLLM puts in logprobs' `tokens`)."""
    if 0 <= token_id < NUM_BUILT_IN:
        return _id_to_text[token_id]
    return _piece(token_id).decode("utf-8", errors="replace")


def is_valid_id(token_id: int) -> bool:
    return 0 <= token_id < VOCAB_SIZE


def render_chat(messages: list[dict[str, Any]]) -> str:
    """The fixed chat template: `<|role|>\\ncontent\\n` per message + `<|assistant|>\\n`."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _mix(x: int) -> int:
    """splitmix64 finaliser: a fast, well-distributed 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def generation_key(engine_seed: int, request_seed: int | None, prompt_ids: Sequence[int]) -> int:
    """A per-request key; tuple hashing of ints is deterministic across processes."""
    return _mix(hash((engine_seed, request_seed if request_seed is not None else 0, tuple(prompt_ids))) & _MASK64)


def next_token(key: int, position: int, eos_probability: float, allow_eos: bool) -> int:
    r = _mix(key ^ (position * 0x9E3779B97F4A7C15 & _MASK64))
    if allow_eos and eos_probability > 0.0 and (r >> 11) / float(1 << 53) < eos_probability:
        return EOS_ID
    return _GEN_IDS[r % len(_GEN_IDS)]


def fake_logprobs(key: int, position: int, token_id: int, k: int) -> list[tuple[int, float]]:
    """Deterministic (token, logprob) pairs, best first: the sampled token is the top one
    (as with greedy sampling), then alternatives with strictly lower logprobs; max(k, 1)
    pairs in all, as vLLM returns for a sampled token inside the top k."""
    r = _mix(key ^ ((position + 1) * 0xD6E8FEB86659FD93 & _MASK64))
    lp = -((r % 2000) / 1000.0) - 0.001
    out = [(token_id, round(lp, 6))]
    seen = {token_id}
    i = 0
    while len(out) < k and i < 4 * (k + 1):
        alt = _GEN_IDS[_mix(r + i) % len(_GEN_IDS)]
        i += 1
        if alt in seen:
            continue
        seen.add(alt)
        out.append((alt, round(lp - 0.5 * len(out), 6)))
    return out
