"""Request ids and W3C trace context: what a client sends that the engines should see.

- `X-Request-Id`: vLLM (`_base_request_id`) names its answer after the header when a client
  sends one (`cmpl-<X-Request-Id>`, `chatcmpl-...`, `embd-...`) and, with
  `--enable-request-id-headers`, returns it in the answer's `X-Request-Id`. The router
  does both, always: the client-facing id follows the header (it wins over the body's
  `request_id`, as in vLLM) and the answer carries it back. Forwarded routes pass it to
  the one engine that answers; generation legs do not (one request fans out into several
  legs, possibly on one engine, and vLLM's request ids must be unique among the requests
  it runs).
- `traceparent` / `tracestate`: passed to every engine leg of the request, so an engine
  started with `--otlp-traces-endpoint` continues the client's trace. With `[tracing]`
  on, the router's own span for the leg replaces the parent (router/observability/tracing.py).

The headers a leg carries live in a context variable set once per request by
`tracing.middleware`: asyncio copies it into every task the request starts (probe races
included), and `UpstreamClient` adds them to each call.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar, Token
from typing import Any

from aiohttp import web

from router import errors

MAX_REQUEST_ID_CHARS = 512
# W3C Trace Context level 1: version 00, 32 hex trace id, 16 hex parent id, 2 hex flags;
# all-zero ids are invalid. A header that does not parse is dropped, as the spec says.
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
_MAX_TRACESTATE_CHARS = 512
# Printable ASCII without spaces: safe in a header, a log line and a JSON id.
_REQUEST_ID = re.compile(r"^[\x21-\x7e]+$")

# Never mutated in place: each push sets a new dict, so one empty default is safe.
_UPSTREAM: ContextVar[dict[str, str]] = ContextVar("cachehit_upstream_headers", default={})  # noqa: B039


def client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id, checked (400 naming the header when unusable), or None."""
    value = request.headers.get("X-Request-Id")
    if value is None:
        return None
    if not value or len(value) > MAX_REQUEST_ID_CHARS or not _REQUEST_ID.match(value):
        raise errors.RouterError(
            400,
            f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces.",
            param="X-Request-Id",
        )
    return value


def answer_request_id(header_id: str | None, request_id: str) -> str:
    """The X-Request-Id answered: the client's header, else the answer's id when it can be
    a header value (a body's request_id may hold any character), else a fresh one."""
    if header_id is not None:
        return header_id
    if len(request_id) <= MAX_REQUEST_ID_CHARS + 16 and _REQUEST_ID.match(request_id):
        return request_id
    return uuid.uuid4().hex


def trace_headers(request: web.Request) -> dict[str, str]:
    """The client's trace context, when valid."""
    out: dict[str, str] = {}
    tp = request.headers.get("traceparent", "").strip().lower()
    if _TRACEPARENT.match(tp) and not tp.startswith("ff"):
        out["traceparent"] = tp
        ts = request.headers.get("tracestate", "").strip()
        if ts and len(ts) <= _MAX_TRACESTATE_CHARS and ts.isascii() and ts.isprintable():
            out["tracestate"] = ts
    return out


def upstream_headers() -> dict[str, str]:
    """Headers every engine call of the current request carries."""
    return _UPSTREAM.get()


def push_upstream_headers(headers: dict[str, str]) -> Token[Any]:
    """Set for the request being served (tracing.middleware); `pop_upstream_headers` after."""
    return _UPSTREAM.set(headers)


def pop_upstream_headers(token: Token[Any]) -> None:
    _UPSTREAM.reset(token)
