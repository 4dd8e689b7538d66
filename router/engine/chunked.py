"""A chunked HTTP/1.1 body (RFC 9112 7.1) read incrementally: the payload of each read.

Engines (uvicorn) write one SSE event a chunk. Reads of whole plain chunks, the common
case, are read at once (`whole_chunks`); anything else (a read that begins or ends inside
a chunk, extensions, trailers, the last chunk) by the general rules, byte by byte of the
grammar, so a proxy in between that re-chunks the body reads the same.
"""

from __future__ import annotations

import re
from itertools import repeat

MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions

# A chunk with a plain hex size and a payload without CR (an SSE stream as vLLM writes it:
# `data: <json>\n\n`, and JSON holds no raw CR). Possessive: a payload cut short by the
# read is not backtracked through.
_PLAIN_CHUNK = re.compile(rb"([0-9a-fA-F]{1,8})\r\n([^\r]++)\r\n")
_HEX = b"0123456789abcdefABCDEF"
# A read shorter than this (a few token chunks of ~250 bytes; a paced stream's read holds
# one) is read chunk by chunk: the split's lists cost ~2 us more than a few chunks' loop.
_FEW_CHUNKS_BYTES = 2048


class ChunkError(ValueError):
    """The body is not chunked as the grammar says (the connection cannot be trusted)."""


class ChunkedBody:
    """The state of one chunked body between reads."""

    __slots__ = ("_left", "_line", "_trailers", "done", "past_end")

    def __init__(self) -> None:
        self._left = 0  # the current chunk's bytes to come, its CRLF included
        self._line = b""  # a size or trailer line carried over
        self._trailers = False  # past the last chunk, in the trailer section
        self.done = False  # the body's end was read
        self.past_end = False  # bytes came after it (no second response was asked for)

    @property
    def between_chunks(self) -> bool:
        """The next read begins with a chunk: nothing of one is carried over."""
        return not (self._left or self._line or self._trailers)

    @property
    def inside_chunk(self) -> int:
        """The bytes still to come of the chunk the last read ended inside (its payload and
        CRLF; 0 when it ended elsewhere)."""
        return self._left if not self._line else 0

    def feed(self, data: bytes) -> bytes:
        """The payload in `data`; sets `done` at the last chunk's end. ChunkError when the
        body breaks the grammar."""
        out: list[bytes] = []
        pos, n = 0, len(data)
        carried = not self.between_chunks  # a read that began inside a chunk
        if not carried and (whole := whole_chunks(data)) is not None:
            out, pos = whole
        while pos < n:
            left = self._left
            if left:  # inside a chunk: its payload, then its CRLF
                take = n - pos if n - pos < left else left
                payload = left - 2 if left - 2 < take else take
                if payload > 0:
                    out.append(data[pos : pos + payload])
                else:
                    payload = 0
                crlf = take - payload
                if crlf:
                    seen = 2 - (left - payload)  # CRLF bytes read before this piece
                    if data[pos + payload : pos + take] != b"\r\n"[seen : seen + crlf]:
                        raise ChunkError("bad chunk terminator")
                self._left = left - take
                pos += take
                if carried and not self._left and pos < n:
                    carried = False  # the chunk the read began inside is done: whole ones may follow
                    if (whole := whole_chunks(data[pos:])) is not None:
                        out += whole[0]
                        pos += whole[1]
                continue
            if self._line:  # a line carried over from the previous read
                line = self._line + data[pos:]
                end = line.find(b"\r\n")
                if end < 0:
                    self._line = line
                    if len(line) > MAX_CHUNK_LINE:
                        raise ChunkError("chunk-size line too long")
                    break
                pos += end + 2 - len(self._line)
                self._line = b""
                line = line[:end]
            else:
                end = data.find(b"\r\n", pos)
                if end < 0:
                    self._line = data[pos:]
                    if len(self._line) > MAX_CHUNK_LINE:
                        raise ChunkError("chunk-size line too long")
                    break
                line = data[pos:end]
                pos = end + 2
            if self._trailers:
                if not line:  # the blank line ending the trailer section: the body's end
                    self.done = True
                    self.past_end = pos < n
                    break
                continue
            size = line.split(b";", 1)[0].strip()
            try:
                if not size or size.startswith((b"-", b"+", b"0x", b"0X")):
                    raise ValueError
                length = int(size, 16)
            except ValueError:
                raise ChunkError(f"bad chunk size {line[:40]!r}") from None
            if length == 0:
                self._trailers = True
            else:
                self._left = length + 2
        return b"".join(out) if len(out) != 1 else out[0]


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


def leading_chunks(data: bytes, count: int) -> tuple[list[bytes], int]:
    """(the payloads, where they end) of the first `count` chunks of `data` when they are
    whole, each with a bare hex size; else ([], 0)."""
    out, pos = _chunk_by_chunk(data, count)
    return (out, pos) if len(out) == count else ([], 0)


def _chunk_by_chunk(data: bytes, most: int = -1) -> tuple[list[bytes], int]:
    out: list[bytes] = []
    pos, n = 0, len(data)
    find = data.find
    while most:
        most -= 1
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
