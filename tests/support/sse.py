"""Server-sent event bodies as vLLM frames them: one `data: <json>` line and a blank line per
event, ending with `data: [DONE]`."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

DONE = "[DONE]"


def decode_payload(payload: bytes | str) -> Any:
    """One event's data: JSON decoded, the final `[DONE]` kept as the string."""
    if isinstance(payload, str):
        payload = payload.encode()
    return DONE if payload == b"[DONE]" else orjson.loads(payload)


def parse_sse(raw: bytes | str) -> list[Any]:
    """The payloads of a whole SSE body in order (see `decode_payload`). Comments (keep-alives)
    are skipped; any other block that is not one `data: ` line fails the test, as framing is
    part of the wire format under test."""
    if isinstance(raw, str):
        raw = raw.encode()
    events = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        block = block.strip(b"\n")
        if not block or block.startswith(b":"):
            continue
        assert block.startswith(b"data: "), f"unexpected SSE block {block[:300]!r}"
        assert b"\n" not in block, f"unexpected SSE block {block[:300]!r}"
        events.append(decode_payload(block[len(b"data: ") :]))
    return events


async def read_sse(response: aiohttp.ClientResponse) -> list[Any]:
    """`parse_sse` of a streamed aiohttp response, read to its end."""
    return parse_sse(await response.read())
