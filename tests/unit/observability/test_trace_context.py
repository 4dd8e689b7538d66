"""Request ids and W3C trace context (router/observability/trace_context.py): what a client
sends that its answer and the engines should see."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from router.errors import RouterError
from router.observability.trace_context import (
    MAX_REQUEST_ID_CHARS,
    answer_request_id,
    client_request_id,
    pop_upstream_headers,
    push_upstream_headers,
    trace_headers,
    upstream_headers,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _request(**headers: str) -> web.Request:
    return make_mocked_request("POST", "/v1/completions", headers=headers)


def test_client_request_id_is_checked() -> None:
    assert client_request_id(_request()) is None
    assert client_request_id(_request(**{"X-Request-Id": "abc-123"})) == "abc-123"
    for bad in ("", "has space", "x" * (MAX_REQUEST_ID_CHARS + 1), "caf\u00e9"):
        with pytest.raises(RouterError) as e:
            client_request_id(_request(**{"X-Request-Id": bad}))
        assert (e.value.status, e.value.param) == (400, "X-Request-Id")


def test_the_answered_id_is_the_header_else_the_answer_id_when_it_can_be_a_header() -> None:
    assert answer_request_id("client", "cmpl-1") == "client"
    assert answer_request_id(None, "cmpl-1") == "cmpl-1"
    fresh = answer_request_id(None, "cmpl-with space")
    assert fresh != "cmpl-with space"
    assert len(fresh) == 32


def test_only_a_valid_traceparent_is_passed_on_with_its_tracestate() -> None:
    assert trace_headers(_request(traceparent=TRACEPARENT, tracestate="k=v")) == {
        "traceparent": TRACEPARENT,
        "tracestate": "k=v",
    }
    assert trace_headers(_request(traceparent=TRACEPARENT.upper())) == {"traceparent": TRACEPARENT}
    for bad in ("junk", "00-" + "0" * 32 + "-b7ad6b7169203331-01", "ff" + TRACEPARENT[2:]):
        assert trace_headers(_request(traceparent=bad, tracestate="k=v")) == {}


def test_upstream_headers_are_set_for_one_request_and_reset_after() -> None:
    assert upstream_headers() == {}
    token = push_upstream_headers({"traceparent": TRACEPARENT})
    assert upstream_headers() == {"traceparent": TRACEPARENT}
    pop_upstream_headers(token)
    assert upstream_headers() == {}
