"""Server-sent events framing: encoding the client's events, decoding the engines' streams.

vLLM writes every event as `data: <json>\\n\\n`, ends with `data: [DONE]\\n\\n`, and may
interleave `: keep-alive\\n\\n` comments (--sse-keep-alive-interval). The decoder still
implements the general WHATWG rules that matter for a `data`-only stream (\\n, \\r\\n and
\\r line ends, multi-line data, comments, other fields ignored, arbitrary chunk
boundaries) so that a proxy in between or another server cannot desynchronise it; the
common case (LF only, `data: ` prefix) runs on bytes.find and slices, no regexes.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE_PAYLOAD = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
KEEPALIVE_EVENT = b": keep-alive\n\n"

# A line longer than this means the peer is not sending SSE (or is broken); without a
# bound a stream with no newline would grow the buffer until the process dies.
DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024


class SSEError(ValueError):
    """The byte stream cannot be SSE (a line exceeded the size bound)."""


def format_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SSEDecoder:
    """Incremental decoder: `feed` bytes as they arrive, get the completed events' data.

    Each returned item is one event's data (its `data:` lines joined by \\n, as bytes), in
    order, `b"[DONE]"` included as is. Events without data lines (comments, `event:`/`id:`
    only) produce nothing. Call `flush()` at end of stream to get an event whose closing
    blank line never came.
    """

    __slots__ = ("_buf", "_buf_len", "_data", "_max_line", "_skip_lf", "scanned_bytes")

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
        # An unterminated line carried over, in the pieces it arrived in: joined once, when
        # its end arrives. (Joining at every feed copied and rescanned the whole line each
        # time: a 16 MiB chunk in 64 KiB reads cost 3.1 s of CPU, 32 MiB 15.7 s.)
        self._buf: list[bytes] = []
        self._buf_len = 0
        self._data: list[bytes] = []  # data lines of the event being read
        self._skip_lf = False  # last feed ended in \r: a \n starting the next belongs to it
        self._max_line = max_line_bytes
        # Bytes looked at while a line was carried over (each once: the work is linear).
        self.scanned_bytes = 0

    @property
    def idle(self) -> bool:
        """Nothing of an event is carried over: the next byte begins one."""
        return not (self._buf or self._data or self._skip_lf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        out: list[bytes] = []
        if not data:
            return out
        if type(data) is not bytes:  # bytearray / memoryview: the scans below need bytes
            data = bytes(data)
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        elif b"\r" not in data:
            # The common case: whole `data: <json>\n\n` events. A read may also end inside
            # one (a large backlog in reads of a fixed size) and begin with the end of the
            # one before: the events between are split at once all the same.
            if self._buf or self._data:  # the event carried over ends at the first blank line
                if not self._buf and data[:1] == b"\n":
                    head = 1
                elif (head := data.find(b"\n\n") + 2) < 2:
                    return self._feed_lines(data)  # it does not end in this read
                out = self._feed_lines(data[:head])
                data = data[head:]
                if not data or self._buf or self._data:
                    return out + self._feed_lines(data)
            end = data.rfind(b"\n\n") + 2
            if end == len(data) and end >= 2:
                return out + self._whole_events(data) if out else self._whole_events(data)
            if end >= 2:  # whole events, then one cut by the read
                out += self._whole_events(data[:end])
                data = data[end:]
        return out + self._feed_lines(data) if out else self._feed_lines(data)

    def _feed_lines(self, data: bytes) -> list[bytes]:
        """`feed` by the general rules, line by line."""
        out: list[bytes] = []
        if not data:
            return out
        if self._buf:
            # A line is carried over: only the new bytes are scanned for its end.
            self.scanned_bytes += len(data)
            if b"\n" not in data and b"\r" not in data:
                self._buf.append(data)
                self._buf_len += len(data)
                if self._buf_len > self._max_line:
                    raise SSEError(f"SSE line longer than {self._max_line} bytes")
                return out
            self._buf.append(data)
            buf = b"".join(self._buf)
            self._buf = []
            self._buf_len = 0
        else:
            buf = data
        if b"\r" in buf:
            start = self._split_any(buf, out)
        else:
            start = 0
            find = buf.find
            line = self._line
            while True:
                nl = find(b"\n", start)
                if nl < 0:
                    break
                line(buf[start:nl], out)
                start = nl + 1
        if start < len(buf):
            tail = buf[start:]
            self._buf = [tail]
            self._buf_len = len(tail)
            if self._buf_len > self._max_line:
                raise SSEError(f"SSE line longer than {self._max_line} bytes")
        return out

    def _whole_events(self, data: bytes) -> list[bytes]:
        # Every event `data: <one line>`: split at the events' starts in one call, checked by
        # counting the newlines (two an event: none inside one, no comment or other field
        # merged into the event before it). A Python loop over the events cost ~0.5 us each.
        events = (b"\n\n" + data[:-2]).split(b"\n\ndata: ")
        if not events[0] and data.count(b"\n") == 2 * (len(events) - 1):
            del events[0]
            return events
        out: list[bytes] = []
        for ev in data[:-2].split(b"\n\n"):
            if ev[:6] == b"data: " and b"\n" not in ev:
                out.append(ev[6:])
            else:  # comments, other fields, multi-line data, stray blank lines
                for line in ev.split(b"\n"):
                    self._line(line, out)
                self._line(b"", out)
        return out

    def _split_any(self, buf: bytes, out: list[bytes]) -> int:
        """Split on \\r\\n, \\n or \\r; returns where the unterminated tail starts."""
        start = 0
        n = len(buf)
        while start < n:
            cr = buf.find(b"\r", start)
            lf = buf.find(b"\n", start)
            if cr < 0 and lf < 0:
                break
            if cr < 0 or (0 <= lf < cr):
                self._line(buf[start:lf], out)
                start = lf + 1
                continue
            self._line(buf[start:cr], out)
            if cr + 1 < n:
                start = cr + 2 if buf[cr + 1] == 0x0A else cr + 1
            else:
                # \r is the last byte: its \n, if any, arrives with the next feed.
                self._skip_lf = True
                start = n
        return start

    def _line(self, line: bytes, out: list[bytes]) -> None:
        if not line:
            if self._data:
                data = self._data
                out.append(data[0] if len(data) == 1 else b"\n".join(data))
                self._data = []
            return
        if line[:6] == b"data: ":
            self._data.append(line[6:])
            return
        if line[:1] == b":":
            return  # comment (keep-alive)
        colon = line.find(b":")
        if colon < 0:
            field, value = line, b""
        else:
            field, value = line[:colon], line[colon + 1 :]
            if value[:1] == b" ":
                value = value[1:]
        if field == b"data":
            self._data.append(value)
        # event, id, retry and unknown fields carry nothing the router uses.

    def flush(self) -> list[bytes]:
        """End of stream: finish a last line without its newline and an event without its
        blank line. The decoder is then empty and can be reused."""
        out: list[bytes] = []
        if self._buf:
            self._line(b"".join(self._buf), out)
            self._buf = []
            self._buf_len = 0
        self._skip_lf = False
        self._line(b"", out)
        return out
