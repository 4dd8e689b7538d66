"""An engine's HTTP/1.1 response head read strictly (router/engine/http1.py): the status
line, CRLF-terminated header lines without folding, and how the body is framed (chunked,
Content-Length, or read to close) and whether the connection may carry another request."""

from __future__ import annotations

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
