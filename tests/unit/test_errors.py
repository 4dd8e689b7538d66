"""Error bodies (router/errors.py) match vLLM 0.32's ErrorResponse shape; helpers set status,
type, headers."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router import errors
from router.engine.sse import SSEDecoder
from router.errors import RouterError, error_body, sse_error_event


def test_body_is_vllm_error_response_shape() -> None:
    err = RouterError(400, "bad", param="prompt")
    # vLLM: ErrorResponse(error=ErrorInfo(message, type, param, code: int)).model_dump()
    assert err.body() == {"error": {"message": "bad", "type": "BadRequestError", "param": "prompt", "code": 400}}
    assert list(err.body()["error"]) == ["message", "type", "param", "code"]
    assert orjson.loads(err.body_bytes()) == err.body()
    assert error_body(404, "m") == {"error": {"message": "m", "type": "NotFoundError", "param": None, "code": 404}}


def test_explicit_type_and_code_win() -> None:
    err = RouterError(400, "x", type="invalid_request_error", code="bad_field")
    assert err.body()["error"]["type"] == "invalid_request_error"
    assert err.body()["error"]["code"] == "bad_field"


def test_model_not_found_matches_vllm_wording() -> None:
    err = errors.model_not_found("gpt-x", ["tiny", "tiny-lora"])
    assert err.status == 404
    assert err.body() == {
        "error": {
            "message": "The model `gpt-x` does not exist. Valid aliases: tiny, tiny-lora.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_common_helpers() -> None:
    assert errors.bad_request("m", "n").status == 400
    u = errors.unauthorized()
    assert (u.status, u.type, u.headers) == (401, "AuthenticationError", {"WWW-Authenticate": "Bearer"})
    assert errors.payload_too_large(10).status == 413
    assert errors.no_backend("m").status == 503
    assert errors.no_backend("m").type == "ServiceUnavailableError"
    assert errors.upstream_failed("e0", "reset").status == 502
    assert errors.upstream_timeout("e0", "first token", 1.5).status == 504
    assert "1.5 s" in errors.upstream_timeout("e0", "first token", 1.5).message
    assert errors.internal_error().type == "InternalServerError"
    assert errors.route_not_found().body()["error"]["type"] == "Not Found"


def test_retry_after_is_a_positive_integer() -> None:
    assert errors.too_many_requests(0).headers["Retry-After"] == "1"
    assert errors.too_many_requests(2.1).headers["Retry-After"] == "3"
    assert errors.too_many_requests(float("inf")).headers["Retry-After"] == "1"
    assert errors.too_many_requests(5).status == 429
    assert errors.too_many_requests(5).type == "RateLimitError"


def test_sse_error_event_decodes_to_the_body() -> None:
    err = errors.upstream_failed("e1", "connection reset")
    ev = sse_error_event(err)
    assert ev.startswith(b"data: ")
    assert ev.endswith(b"\n\n")
    (payload,) = SSEDecoder().feed(ev)
    assert orjson.loads(payload) == err.body()


def test_from_upstream_body_passes_vllm_errors_through() -> None:
    raw = orjson.dumps(
        {
            "error": {
                "message": "temperature must be >= 0",
                "type": "BadRequestError",
                "param": "temperature",
                "code": 400,
            }
        }
    )
    err = errors.from_upstream_body(400, raw)
    assert (err.status, err.param, err.message) == (400, "temperature", "temperature must be >= 0")
    assert err.body() == orjson.loads(raw)


def test_from_upstream_body_odd_bodies_become_502() -> None:
    assert errors.from_upstream_body(500, b"<html>oops</html>").status == 502
    assert errors.from_upstream_body(400, b"[1]").status == 502
    # The engine refusing the router's own key is a router configuration fault.
    assert errors.from_upstream_body(401, b'{"error": "Unauthorized"}').status == 502


def test_from_error_object_midstream_event() -> None:
    obj = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
    err = errors.from_error_object(obj)
    assert err is not None
    assert err.status == 500
    assert err.type == "InternalServerError"
    assert errors.from_error_object({"choices": []}) is None


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200), st.integers(100, 599))
def test_from_upstream_body_never_raises(raw: bytes, status: int) -> None:
    err = errors.from_upstream_body(status, raw)
    assert 400 <= err.status <= 599
    orjson.dumps(err.body())


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
        max_leaves=10,
    )
)
def test_from_error_object_never_raises(value: Any) -> None:
    err = errors.from_error_object({"error": value})
    if err is not None:
        orjson.dumps(err.body())
        assert 100 <= err.status <= 599


def test_model_not_found_equals_the_real_capture() -> None:
    from support.wire_captures import body

    assert errors.model_not_found("no-such-model", ["tiny"]).body() == body("error_unknown_model")
    assert errors.model_not_found("no-such-model", ["tiny"]).body() == body("error_unknown_model_chat")


def test_real_error_body_passes_through() -> None:
    from support.wire_captures import load

    d = load("error_out_of_range_temperature")
    err = errors.from_upstream_body(d["status"], d["raw"].encode())
    assert err.status == 400
    assert err.body() == orjson.loads(d["raw"])
