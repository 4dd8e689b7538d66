"""Client-facing errors in the exact JSON shape vLLM 0.32 uses.

vLLM answers every error with `ErrorResponse` (vllm/entrypoints/serve/engine/protocol.py),
serialized by `model_dump()`:

    {"error": {"message": str, "type": str, "param": str | null, "code": int}}

`code` is the HTTP status as an integer (vLLM's `ErrorInfo.code: int`), never an OpenAI
string code, so clients written against vLLM keep working behind the router.

`type` follows vLLM, which names errors after the OpenAI SDK's exception classes
(`BadRequestError`, `NotFoundError`, `InternalServerError`, `ServiceUnavailableError`;
see serve/exception_handling/error_response.py). Statuses vLLM never produces itself get
the SDK's name where the SDK has one (`AuthenticationError`, `RateLimitError`, ...) and
otherwise a name built the same way (`PayloadTooLargeError`, `BadGatewayError`,
`GatewayTimeoutError`). The table is `_TYPE_BY_STATUS`.

Two deliberate differences from vLLM:
- 401: vLLM's auth middleware answers `{"error": "Unauthorized"}` (a bare string). The
  router uses the full error object, which OpenAI clients can parse (`error.message`).
- messages are written by the router and never contain paths or tracebacks, so vLLM's
  `sanitize_message` is not needed.

Once a stream has started (HTTP 200 sent) an error can only travel as an event: vLLM
then sends `data: <ErrorResponse JSON>\\n\\n` followed by `data: [DONE]\\n\\n`
(`completion_stream_generator` / `chat_completion_stream_generator`); `sse_error_event`
builds the first of those two.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

_TYPE_BY_STATUS: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "PayloadTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type_for(status: int) -> str:
    """The `type` the router uses for `status` (see module docstring)."""
    known = _TYPE_BY_STATUS.get(status)
    if known is not None:
        return known
    return "InternalServerError" if status >= 500 else "BadRequestError"


def error_body(
    status: int, message: str, *, type: str | None = None, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`; `code` defaults to `status`."""
    return {
        "error": {
            "message": message,
            "type": type if type is not None else error_type_for(status),
            "param": param,
            "code": code if code is not None else status,
        }
    }


class RouterError(Exception):
    """An error the router answers itself, carrying its HTTP status and extra headers.

    `type=None` (the default) picks the vLLM-style name for `status`; `code=None` puts the
    status in `code` as vLLM does.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type if type is not None else error_type_for(status)
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers or {}
        self.reason = ""  # why a 429 was given (metrics); see too_many_requests

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, type=self.type, param=self.param, code=self.code)

    def body_bytes(self) -> bytes:
        return orjson.dumps(self.body())

    def __repr__(self) -> str:
        return f"RouterError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r})"


def sse_error_event(err: RouterError) -> bytes:
    """The event vLLM sends when a stream fails after it started; the writer then adds
    `data: [DONE]` like vLLM does."""
    return b"data: " + orjson.dumps(err.body()) + b"\n\n"


# --- the common cases -------------------------------------------------------------------


def bad_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, param=param)


def unauthorized(message: str = "Invalid or missing API key.") -> RouterError:
    # WWW-Authenticate tells generic HTTP clients which scheme to use (RFC 9110 11.6.1).
    return RouterError(401, message, headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str, served: list[str] | tuple[str, ...]) -> RouterError:
    """vLLM's exact wording and fields for an unknown model (BaseServing._check_model)."""
    return RouterError(
        404,
        f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
        type="NotFoundError",
        param="model",
    )


def route_not_found() -> RouterError:
    """What vLLM (Starlette) answers for an unknown path: the HTTP phrase as type and message."""
    return RouterError(404, "Not Found", type="Not Found")


def method_not_allowed() -> RouterError:
    return RouterError(405, "Method Not Allowed", type="Method Not Allowed")


def payload_too_large(limit_bytes: int) -> RouterError:
    return RouterError(413, f"Request body exceeds the limit of {limit_bytes} bytes.")


def too_many_requests(retry_after_s: float, message: str | None = None, *, reason: str = "queue") -> RouterError:
    """429 with Retry-After in whole seconds (rounded up, at least 1: RFC 9110 10.2.3
    only allows an integer, and 0 would invite an immediate retry storm). `reason` labels
    the rejection's metric: queue, queue_timeout, rate, tenant_queue."""
    secs = max(1, math.ceil(retry_after_s)) if math.isfinite(retry_after_s) else 1
    err = RouterError(
        429, message or f"The router is at capacity; retry after {secs} s.", headers={"Retry-After": str(secs)}
    )
    err.reason = reason
    return err


def no_backend(model: str | None) -> RouterError:
    """503: no healthy backend can serve the model right now (all down or circuits open)."""
    what = f"model `{model}`" if model else "this request"
    return RouterError(503, f"No healthy backend is available for {what}; retry later.")


def upstream_failed(backend: str, detail: str) -> RouterError:
    """502: an engine answered something unusable (connection reset, malformed stream)."""
    return RouterError(502, f"Upstream engine {backend!r} failed: {detail}")


def upstream_timeout(backend: str | None, what: str, timeout_s: float) -> RouterError:
    """504: `what` (e.g. "first token", "next chunk", "whole request") took over timeout_s."""
    who = f"upstream engine {backend!r}" if backend else "upstream engines"
    return RouterError(504, f"Timed out after {timeout_s:g} s waiting for the {what} from {who}.")


def internal_error(message: str = "Internal router error.") -> RouterError:
    return RouterError(500, message)


def from_upstream_body(status: int, raw: bytes) -> RouterError:
    """An engine's own error answer (before any stream), passed through to the client as is:
    an engine's 400 on a sampling field the router does not validate must reach the client
    with vLLM's message and param. A body that is not vLLM's error shape becomes a 502, and
    so does 401/403: the engine refused the router's own key, a configuration fault the
    client cannot fix."""
    if status in (401, 403):
        return RouterError(
            502, f"Upstream engine refused the router's credentials (HTTP {status}); check backends[].api_key."
        )
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    err = from_error_object(obj, status) if isinstance(obj, dict) else None
    if err is None:
        snippet = raw[:200].decode("utf-8", "replace")
        return RouterError(502, f"Upstream engine answered HTTP {status} with an unexpected body: {snippet!r}")
    return err


def from_error_object(obj: dict[str, Any], status: int | None = None) -> RouterError | None:
    """A parsed `{"error": {...}}` object (an engine's error body or a mid-stream error
    event) as a RouterError, or None when `obj` is not an error object. The status is the
    object's integer `code` when it looks like an HTTP status, else `status`, else 500."""
    e = obj.get("error")
    if isinstance(e, str):  # vLLM's auth middleware shape: {"error": "Unauthorized"}
        st = status or 500
        return RouterError(st, e)
    if not isinstance(e, dict):
        return None
    code = e.get("code")
    st = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599 else (status or 500)
    message = e.get("message")
    etype = e.get("type")
    param = e.get("param")
    return RouterError(
        st,
        message if isinstance(message, str) else "Upstream engine error.",
        type=etype if isinstance(etype, str) else None,
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, (int, str)) and not isinstance(code, bool) else None,
    )
