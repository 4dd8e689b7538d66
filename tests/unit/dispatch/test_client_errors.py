"""What a client is told about an upstream failure (router/dispatch/client_errors.py)."""

from __future__ import annotations

import pytest

from router.config.schema import TimeoutsConfig
from router.dispatch.client_errors import client_error
from router.engine.errors import (
    CONNECT,
    CONNECT_TIMEOUT,
    FIRST_TOKEN_TIMEOUT,
    IDLE_TIMEOUT,
    STATUS,
    TOTAL_TIMEOUT,
    UpstreamError,
)


def test_an_engines_own_client_error_is_passed_through_with_its_status_and_message() -> None:
    body = b'{"error": {"message": "max_tokens is too large", "type": "BadRequestError", "param": "max_tokens", "code": 400}}'
    e = client_error(UpstreamError("d0", STATUS, "400", status=400, body=body), TimeoutsConfig())
    assert e.status == 400
    assert "max_tokens is too large" in e.message


@pytest.mark.parametrize(
    ("kind", "what", "seconds"),
    [
        (FIRST_TOKEN_TIMEOUT, "first token", 7.0),
        (IDLE_TIMEOUT, "next chunk", 8.0),
        (TOTAL_TIMEOUT, "whole answer", 9.0),
        (CONNECT_TIMEOUT, "connection", 3.0),
    ],
)
def test_a_timeout_says_what_was_awaited_and_for_how_long(kind: str, what: str, seconds: float) -> None:
    timeouts = TimeoutsConfig(first_token_s=7.0, idle_s=8.0, total_s=9.0, connect_s=3.0)
    e = client_error(UpstreamError("d0", kind, "slow"), timeouts)
    assert e.status == 504
    assert f"after {seconds:g} s waiting for the {what}" in e.message


def test_an_unreachable_engine_and_any_other_failure_are_a_502_naming_the_engine() -> None:
    timeouts = TimeoutsConfig()
    unreachable = client_error(UpstreamError("d0", CONNECT, "refused"), timeouts)
    other = client_error(UpstreamError("d1", "protocol", "bad chunk"), timeouts)
    assert (unreachable.status, other.status) == (502, 502)
    assert "d0" in unreachable.message
    assert "refused" in unreachable.message
    assert "d1" in other.message
    assert "bad chunk" in other.message
