"""vLLM's runtime LoRA API on the router: `POST /v1/load_lora_adapter {"lora_name",
"backend"?}` and `POST /v1/unload_lora_adapter {"lora_name", "backend"?}`.

Only the admin key may call them (with `server.admin_api_key`; without one they answer 404
like any unknown route): loading an adapter takes an engine's memory for every tenant.
Unlike vLLM's own route, the body names no path: the router sends the engines the path
`[routing.lora_adapters]` gives for the name, so no client can make an engine read a file
of its choosing (a `lora_path` is refused). Without `backend`, a load goes to the engine
the cost model picks and an unload to every engine holding the adapter. The answer names
the backends; the router's view is updated before it (router/fleet/adapters.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from router import errors
from router.server.respond import error_response, json_response

if TYPE_CHECKING:
    from router.fleet.adapters import AdapterManager
    from router.server.state import RouterState

_FIELDS = {"lora_name", "backend"}


def _request(raw: bytes) -> tuple[str, str | None]:
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise errors.bad_request("The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise errors.bad_request("The body must be a JSON object.")
    if "lora_path" in body:
        raise errors.bad_request(
            "'lora_path' is not taken from requests: the router loads the path its configuration "
            "gives for the adapter (routing.lora_adapters).",
            param="lora_path",
        )
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise errors.bad_request(f"Unknown field {unknown[0]!r}; expected lora_name, backend.", param=unknown[0])
    name, backend = body.get("lora_name"), body.get("backend")
    if not isinstance(name, str) or not name:
        raise errors.bad_request("'lora_name' must be a non-empty string.", param="lora_name")
    if backend is not None and not isinstance(backend, str):
        raise errors.bad_request("'backend' must be a string.", param="backend")
    return name, backend


class LoraApi:
    def __init__(self, state: RouterState):
        self.state = state

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/load_lora_adapter", self.handle_load)
        router.add_post("/v1/unload_lora_adapter", self.handle_unload)

    async def _admitted(self, request: web.Request) -> tuple[str, str | None]:
        """The adapter and backend an admitted request names; the admin refusal or a bad
        body is the RouterError the handler answers with."""
        refused = self.state.keys.admin_refusal(request.headers)
        if refused is not None:
            raise refused
        return _request(await request.read())

    def _adapters(self) -> AdapterManager:
        adapters = self.state.adapters
        assert adapters is not None
        return adapters

    async def handle_load(self, request: web.Request) -> web.Response:
        try:
            name, backend = await self._admitted(request)
            loaded_on = await self._adapters().load(name, backend)
        except errors.RouterError as e:
            return error_response(e)
        return json_response({"lora_name": name, "backends": [loaded_on]})

    async def handle_unload(self, request: web.Request) -> web.Response:
        try:
            name, backend = await self._admitted(request)
            left = await self._adapters().unload(name, backend)
        except errors.RouterError as e:
            return error_response(e)
        if not left:
            return error_response(errors.RouterError(404, f"No engine holds LoRA adapter {name!r}.", param="lora_name"))
        return json_response({"lora_name": name, "backends": left})
