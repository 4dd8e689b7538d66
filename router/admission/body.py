"""Reading a client's request body within the server's limits.

The size limit is checked from the headers before anything is read; `Expect:
100-continue` is answered only once the request passed authentication and holds a slot, so
a body that would be refused is never invited; the body must arrive within
`server.body_timeout_s`, one deadline for the whole body, counted from when the router
starts reading it (a client sending a byte every second does not reset it). For audio
uploads only the form fields before the file part are read here (where clients put
`model`); the rest streams upstream (router/server/forward.py) through the same
`BodyReader`, under the same deadline.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson
from aiohttp import web

from router import errors
from router.config.schema import ServerConfig

# Form fields read before the file part of an upload to find `model`; past it, any engine.
MAX_FORM_PREFIX_BYTES = 64 * 1024
_PART_NAME = re.compile(rb'name="([^"]*)"', re.IGNORECASE)
FORM_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)


# What a request in flight costs the router (docs/RELIABILITY.md, "Limits and timeouts";
# measured by `python -m bench limits`): a fixed part (its record, stream, buffers, timers)
# and a part proportional to its body: the parsed body (a prompt of token ids is a list of
# Python ints, ~36 bytes per ~7-byte id), its routing text, the legs' serialised bodies,
# and the engine's answers that echo the prompt's token ids (parsed as they arrive).
# Measured: up to ~20x its body (a 4 MiB prompt of token ids, 16 held at once: 73-79 MiB
# each at the peak, bench/RESULTS.md "Limits"); the bound counts 24x.
REQUEST_OVERHEAD_BYTES = 128 * 1024
BODY_COST_FACTOR = 24


def memory_per_request_bound(server: ServerConfig) -> int:
    """What one request in flight may cost the router, in bytes, with a body of
    server.max_body_bytes."""
    return REQUEST_OVERHEAD_BYTES + BODY_COST_FACTOR * server.max_body_bytes


def memory_bound(server: ServerConfig) -> int:
    """What the requests in flight may cost the router at once, above its idle memory:
    every slot's fixed part, and the bodies' part within server.max_body_bytes_in_flight."""
    bodies = min(server.max_body_bytes_in_flight, server.max_concurrent_requests * server.max_body_bytes)
    return server.max_concurrent_requests * REQUEST_OVERHEAD_BYTES + BODY_COST_FACTOR * bodies


def body_reservation(request: web.Request, server: ServerConfig) -> int:
    """The bytes a request reserves in the body budget (router/admission/body_budget.py):
    its Content-Length, or server.max_body_bytes for a body without one (chunked)."""
    length = request.content_length
    return server.max_body_bytes if length is None else length


def check_length(request: web.Request, server: ServerConfig) -> None:
    """413 for a declared Content-Length over server.max_body_bytes."""
    length = request.content_length  # parsed from the headers on every access
    if length is not None and length > server.max_body_bytes:
        raise errors.payload_too_large(server.max_body_bytes)


async def read_body(request: web.Request, server: ServerConfig) -> bytes:
    """The whole body, or a RouterError: 413 too large, 400 unreadable, 408 too slow."""
    check_length(request, server)
    timeout = server.body_timeout_s
    try:
        if not request.content.is_eof():
            await invite_body(request)
        if request.content.is_eof():
            # The whole body is already buffered (a small body arrives with the
            # headers): reading cannot wait, so no timer to arm and cancel.
            return await _read_all(request, server.max_body_bytes)
        async with asyncio.timeout(timeout):
            return await _read_all(request, server.max_body_bytes)
    except web.RequestPayloadError as e:
        # The body is not what its headers say (a Content-Encoding it is not encoded
        # in, broken chunked framing): the client's error.
        detail = getattr(e.__cause__, "message", None) or str(e)
        raise errors.RouterError(400, f"The request body could not be read: {detail.strip()}") from None
    except TimeoutError:
        raise body_timeout(server) from None


async def read_json_object(request: web.Request, server: ServerConfig) -> tuple[bytes, dict[str, Any], str | None]:
    """A forwarded JSON route's body: its bytes, the object they hold and its `model`
    (400 for a body that is not a JSON object or a `model` that is not a string)."""
    raw = await read_body(request, server)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise errors.bad_request(f"Request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise errors.bad_request("Request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.bad_request("`model` must be a string.", "model")
    return raw, body, model


async def _read_all(request: web.Request, limit: int) -> bytes:
    """The body's bytes, one copy: `request.read()` would also keep them on the request
    for as long as it lives (the whole answer), beside the parsed body."""
    chunks: list[bytes] = []
    size = 0
    while data := await request.content.readany():
        size += len(data)
        if size > limit:  # a chunked body (no Content-Length) past the limit
            raise errors.payload_too_large(limit)
        chunks.append(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def body_timeout(server: ServerConfig) -> errors.RouterError:
    return errors.RouterError(
        408, f"The request body did not arrive within server.body_timeout_s = {server.body_timeout_s:g} s."
    )


class BodyReader:
    """A client's body read piece by piece (an upload's form fields, then its file
    streamed upstream) under one deadline for all of it: `server.body_timeout_s` from the
    reader's creation. Past it, `readany` raises TimeoutError and `error` is the 408."""

    def __init__(self, request: web.Request, server: ServerConfig):
        self._content = request.content
        self._server = server
        self.deadline = asyncio.get_running_loop().time() + server.body_timeout_s
        self.error: errors.RouterError | None = None

    async def readany(self) -> bytes:
        try:
            async with asyncio.timeout_at(self.deadline):
                return await self._content.readany()
        except TimeoutError:
            self.error = body_timeout(self._server)
            raise


async def expect_handler(request: web.Request) -> web.Response | None:
    """`Expect: 100-continue` on the generation routes is answered later, by
    `invite_body`, once the request passed authentication and the size check and holds
    a slot: a body that would be refused (401, 413, 429) is never invited."""
    expect = request.headers.get("Expect", "")
    if expect.lower() == "100-continue":
        return None
    err = errors.RouterError(417, f"Unknown Expect: {expect[:80]!r}")
    resp = web.Response(body=err.body_bytes(), status=err.status, content_type="application/json")
    resp.force_close()
    return resp


async def invite_body(request: web.Request) -> None:
    if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")


def model_from_form_prefix(prefix: bytes, boundary: bytes) -> tuple[bool, str | None]:
    """(decided, model) from the start of a multipart/form-data body: decided once the
    `model` field is complete or a file part has begun (then None: not sent before it)."""
    delim = b"--" + boundary
    parts = prefix.split(delim)
    for i, part in enumerate(parts[1:], start=1):
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep:
            return False, None  # the part's headers are not all here yet
        m = _PART_NAME.search(head)
        if b"filename=" in head.lower():
            return True, None
        if m is None or m.group(1) != b"model":
            continue
        if i == len(parts) - 1:
            return False, None  # the value may still be arriving
        return True, value.removesuffix(b"\r\n").decode("utf-8", "replace").strip() or None
    return False, None


async def read_form_prefix(reader: BodyReader, boundary: bytes) -> tuple[bytes, str | None]:
    """The upload's first bytes, up to the `model` field or the file part, and that model
    (within the reader's deadline: a 408 past it)."""
    prefix = b""
    while len(prefix) < MAX_FORM_PREFIX_BYTES:
        decided, model = model_from_form_prefix(prefix, boundary)
        if decided:
            return prefix, model
        try:
            data = await reader.readany()
        except TimeoutError:
            assert reader.error is not None
            raise reader.error from None
        if not data:
            break
        prefix += data
    return prefix, model_from_form_prefix(prefix, boundary)[1]
