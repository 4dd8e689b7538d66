"""Why an engine call failed: `UpstreamError` and its kinds, in the words a client error
message uses, with whose fault it was (the engine's, or the request's own)."""

from __future__ import annotations

from typing import Any

# Failure kinds, in the words a client error message uses.
CONNECT = "connect"  # could not connect / connection refused
CONNECT_TIMEOUT = "connect_timeout"  # no TCP connection within timeouts.connect_s
STATUS = "status"  # the engine answered an HTTP error status
FIRST_TOKEN_TIMEOUT = "first_token_timeout"
IDLE_TIMEOUT = "idle_timeout"
TOTAL_TIMEOUT = "total_timeout"
BROKEN = "broken"  # the stream ended without [DONE] or the connection dropped
ENGINE_ERROR = "engine_error"  # the engine sent an error event mid-stream
PROTOCOL = "protocol"  # unparseable chunk
TOO_LARGE = "too_large"  # a non-streamed answer past the bound the router reads (client.py)

# How much of an engine's error answer is read and kept (passed on to the client, logged).
MAX_ERROR_BODY = 64 * 1024


class AnswerTooLarge(Exception):
    """An engine's body went past what the router reads of it (`limit` bytes)."""

    def __init__(self, what: str, limit: int):
        super().__init__(f"{what} is larger than the {limit} bytes the router reads of it")
        self.limit = limit


class UpstreamError(Exception):
    def __init__(self, backend: str, kind: str, detail: str, *, status: int | None = None, body: Any = None):
        super().__init__(f"backend {backend}: {kind}: {detail}")
        self.backend = backend
        self.kind = kind
        self.detail = detail
        self.status = status
        self.body = body  # STATUS: the engine's raw answer (bytes); ENGINE_ERROR: the event

    @property
    def client_fault(self) -> bool:
        """The engine refused the request itself (4xx): no other engine would accept it."""
        return (
            self.kind == STATUS
            and self.status is not None
            and 400 <= self.status < 500
            and self.status not in (408, 429)
        )

    @property
    def backend_fault(self) -> bool:
        """Counts against the backend's health (breaker, retries)."""
        return not self.client_fault


def status_error(backend: str, status: int, body: bytes) -> UpstreamError:
    """An engine's HTTP error status, with (the start of) its answer: the same error from
    the aiohttp client and the hand-written leg."""
    return UpstreamError(
        backend, STATUS, f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}", status=status, body=body
    )
