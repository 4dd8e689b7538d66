"""vLLM-shaped API errors of the simulator: `{"error": {"message", "type", "param",
"code"}}` with vLLM's status codes and wording (value checks, request-schema errors as
pydantic words them, invalid JSON)."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type or (
            "BadRequestError" if status == 400 else HTTPStatus(status).phrase.replace(" ", "") + "Error"
        )
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


_NO_VALUE = object()


def value_error(message: str, param: str, value: Any = _NO_VALUE) -> ApiError:
    """vLLM's VLLMValidationError: the message ends with the parameter (and value)."""
    if value is _NO_VALUE:
        return ApiError(f"{message} (parameter={param})", param=param)
    return ApiError(f"{message} (parameter={param}, value={value})", param=param)


# kind -> (pydantic error type, message) as pydantic v2 words them.
_SCHEMA = {
    "int": ("int_type", "Input should be a valid integer"),
    "number": ("float_type", "Input should be a valid number"),
    "bool": ("bool_type", "Input should be a valid boolean"),
    "str": ("string_type", "Input should be a valid string"),
    "dict": ("dict_type", "Input should be a valid dictionary"),
    "list": ("list_type", "Input should be a valid list"),
}


def schema_error(param: str, kind: str, value: Any) -> ApiError:
    """A request-model validation error, in the shape of vLLM's validation handler."""
    err_type, msg = _SCHEMA.get(kind, ("value_error", f"Input should be {kind}"))
    if kind == "int" and isinstance(value, str):
        err_type, msg = "int_parsing", msg + ", unable to parse string as an integer"
    elif kind == "number" and isinstance(value, str):
        err_type, msg = "float_parsing", msg + ", unable to parse string as a number"
    elif kind == "bool" and isinstance(value, str):
        err_type, msg = "bool_parsing", msg + ", unable to interpret input"
    return ApiError(
        f"1 validation error:\n  {{'type': '{err_type}', 'loc': 'body.{param}', 'msg': '{msg}', 'input': {value!r}}}",
        400,
        "Bad Request",
        f"body.{param}",
    )


def json_error(text: str) -> ApiError:
    """Invalid JSON, worded and located (character offset) like vLLM's answer."""
    try:
        json.loads(text)
        pos, why = 0, "Invalid JSON"
    except json.JSONDecodeError as e:
        pos, why = e.pos, e.msg
    except ValueError as e:  # e.g. undecodable bytes
        pos, why = 0, str(e)
    return ApiError(
        f"1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.{pos}', "
        f"'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': "
        f"{{'error': '{why}'}}}}",
        400,
        "Bad Request",
        f"body.{pos}",
    )


__all__ = ["ApiError", "json_error", "schema_error", "value_error"]
