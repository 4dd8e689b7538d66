"""An engine's HTTP/1.1 response head read strictly (router/engine/http1.py): the status
line, CRLF-terminated header lines without folding, and how the body is framed (chunked,
Content-Length, or read to close) and whether the connection may carry another request."""

from __future__ import annotations

import re
from itertools import repeat

MAX_HEAD_BYTES = 64 * 1024  # status line and headers of one response

# Body framing.
CHUNKED, LENGTH, TO_CLOSE = 0, 1, 2


class HeadError(ValueError):
    """The engine's response head is not HTTP/1.1 as this client reads it."""


def parse_head(head: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]], bool]:
    """(status, reason, headers with lower-cased names, HTTP/1.1 or not) of a response head
    without its final blank line."""
    lines = head.split(b"\r\n")
    status_line = lines[0]
    version, sp, rest = status_line.partition(b" ")
    if not sp or version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HeadError(f"bad status line {status_line[:100]!r}")
    code, _, reason = rest.partition(b" ")
    if len(code) != 3 or not code.isdigit():
        raise HeadError(f"bad status line {status_line[:100]!r}")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or b"\n" in line or b"\r" in line:
            raise HeadError(f"bad header line {line[:100]!r}")  # folding, bare CR/LF, no name
        headers.append((name.lower(), value.strip(b" \t")))
    return int(code), reason, headers, version == b"HTTP/1.1"


def body_framing(status: int, headers: list[tuple[bytes, bytes]], http11: bool) -> tuple[int, int, bool]:
    """(framing, Content-Length or 0, keep-alive) of a response to a POST."""
    keep_alive = http11
    te: bytes | None = None
    lengths: set[bytes] = set()
    for name, value in headers:
        if name == b"transfer-encoding":
            te = value.lower() if te is None else te + b"," + value.lower()
        elif name == b"content-length":
            lengths.update(v.strip() for v in value.split(b","))
        elif name == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens:
                keep_alive = True
    if status in (204, 304):
        return LENGTH, 0, keep_alive
    if te is not None:
        if [c.strip() for c in te.split(b",")] != [b"chunked"]:
            raise HeadError(f"unsupported Transfer-Encoding {te[:100]!r}")
        # With both, Transfer-Encoding wins and the connection is not reused (RFC 9112 6.3).
        return CHUNKED, 0, keep_alive and not lengths
    if lengths:
        if len(lengths) != 1 or not (length := lengths.pop()).isdigit():
            raise HeadError("bad Content-Length")
        return LENGTH, int(length), keep_alive
    return TO_CLOSE, 0, False


# A chunk with a plain hex size and a payload without CR (an SSE stream as vLLM writes it:
# `data: <json>\n\n`, and JSON holds no raw CR). Possessive: a payload cut short by the
# read is not backtracked through.
_PLAIN_CHUNK = re.compile(rb"([0-9a-fA-F]{1,8})\r\n([^\r]++)\r\n")
_HEX = b"0123456789abcdefABCDEF"
# A read shorter than this (a few token chunks of ~250 bytes; a paced stream's read holds
# one) is read chunk by chunk: the split's lists cost ~2 us more than a few chunks' loop.
_FEW_CHUNKS_BYTES = 2048


def whole_chunks(data: bytes) -> tuple[list[bytes], int] | None:
    """(the payloads, where the rest starts) of the whole chunks `data` begins with, when
    they are of the plain kind; else None (the caller reads them by the general rules).
    What follows them (a chunk cut by the read, the last chunk, one of another kind) is
    the rest. Many chunks: one regular expression split and two maps (a Python step a
    chunk cost ~0.6 us of CPU); a short read (a paced stream's holds one chunk): a loop of a
    few C calls a chunk."""
    if len(data) < _FEW_CHUNKS_BYTES:
        return _chunk_by_chunk(data)
    pieces = _PLAIN_CHUNK.split(data)
    # [before, size, payload, between, size, payload, ..., rest]: nothing before or between.
    if len(pieces) == 1 or pieces[0] or any(pieces[3:-1:3]):
        return None
    payloads = pieces[2::3]
    if list(map(len, payloads)) != list(map(int, pieces[1::3], repeat(16))):
        return None  # a size that is not its payload's: the general rules say what is wrong
    return payloads, len(data) - len(pieces[-1])


def _chunk_by_chunk(data: bytes) -> tuple[list[bytes], int]:
    out: list[bytes] = []
    pos, n = 0, len(data)
    find = data.find
    while True:
        end = find(b"\r\n", pos)
        size = data[pos:end]
        if end < 0 or not size or size.strip(_HEX):
            break  # cut by the read, an extension or not hex: the rest
        stop = end + 2 + int(size, 16)
        if stop + 2 > n or stop == end + 2 or data[stop : stop + 2] != b"\r\n":
            break  # cut by the read, the last chunk, or a bad terminator: the rest
        out.append(data[end + 2 : stop])
        pos = stop + 2
    return out, pos
