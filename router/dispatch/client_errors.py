"""What a client is told about an upstream failure the router could not route around: the
engine's own 4xx passed through, timeouts named by the key that bounds them, else a 502."""

from __future__ import annotations

from router import errors
from router.config.schema import TimeoutsConfig
from router.engine.errors import (
    CONNECT,
    CONNECT_TIMEOUT,
    FIRST_TOKEN_TIMEOUT,
    IDLE_TIMEOUT,
    TOTAL_TIMEOUT,
    UpstreamError,
)


def client_error(e: UpstreamError, timeouts: TimeoutsConfig) -> errors.RouterError:
    """What the client is told about an upstream failure the router could not route around."""
    if e.client_fault:
        return errors.from_upstream_body(e.status or 400, e.body or b"")
    if e.kind == FIRST_TOKEN_TIMEOUT:
        return errors.upstream_timeout(e.backend, "first token", timeouts.first_token_s)
    if e.kind == IDLE_TIMEOUT:
        return errors.upstream_timeout(e.backend, "next chunk", timeouts.idle_s)
    if e.kind == TOTAL_TIMEOUT:
        return errors.upstream_timeout(e.backend, "whole answer", timeouts.total_s)
    if e.kind == CONNECT_TIMEOUT:
        return errors.upstream_timeout(e.backend, "connection", timeouts.connect_s)
    if e.kind == CONNECT:
        return errors.RouterError(502, f"Cannot reach upstream engine {e.backend!r}: {e.detail}")
    return errors.upstream_failed(e.backend, f"{e.kind}: {e.detail}")
