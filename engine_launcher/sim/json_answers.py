"""JSON answers of the simulator's routes: a body as application/json, and an `ApiError`
as vLLM's error answer."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from .api_errors import ApiError


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def error_response(e: ApiError) -> web.Response:
    return json_response(e.body(), e.status)


__all__ = ["error_response", "json_response"]
