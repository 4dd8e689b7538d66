"""What the router logs about its clients: escaped text, expected events on one line.

Anything a client sent (request ids, model names, the bytes of a request line or header
that aiohttp quotes in its parse errors) is escaped before it reaches a log line: no
CR/LF to forge lines, no NUL, no terminal escapes, no bidi overrides. Expected client
events, a malformed HTTP message or a connection dropped mid-answer, are one INFO line
without a traceback; tracebacks are kept for the router's own bugs, so operators are not
drowned in what hostile or impatient clients do.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from aiohttp import http_exceptions, web_protocol

# A log line quotes at most this much of what a client sent.
MAX_LOGGED_CHARS = 300


def escape(text: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """`text` with every non-printable character (and the backslash, so that an escape
    cannot be forged) written as a Python escape, cut to `limit` characters."""
    s = text if isinstance(text, str) else str(text)
    if len(s) > limit:
        s = s[:limit] + "..."
    if s.isprintable() and "\\" not in s:
        return s
    return "".join(_escape_char(c) for c in s)


def _escape_char(c: str) -> str:
    if c == "\\":
        return "\\\\"
    if c.isprintable():
        return c
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def is_client_event(exc: BaseException | None) -> bool:
    """A failure the client caused: a malformed HTTP message (aiohttp's parser errors),
    a body that is not what its headers say, or a connection the client dropped."""
    return isinstance(exc, (http_exceptions.HttpProcessingError, web_protocol.RequestPayloadError, ConnectionError))


class ServerLogger(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server logger (`logger=` of the web server): its "Error handling
    request" reports of client events become one escaped INFO line; anything else keeps
    its traceback."""

    def __init__(self, logger: logging.Logger | None = None):
        super().__init__(logger or logging.getLogger("aiohttp.server"), {})

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if is_client_event(exc):
            text = str(msg) % args if args else str(msg)
            self.logger.info("client event: %s: %s: %s", escape(text), type(exc).__name__, escape(exc))
            return
        self.logger.error(msg, *args, exc_info=exc_info, **kwargs)
