"""The admin API: list the backends, add and remove them at run time, drain and enable them.

Routes (only with `server.admin_api_key`, and only for that key; without it they answer 404
like any unknown route): GET /admin/backends, POST /admin/backends {"name", "url", "role",
"models"}, DELETE /admin/backends/{name}, POST /admin/backends/{name}/drain and .../enable.
Backends that come and go are the fleet's business (router/fleet/membership.py); this module only
translates HTTP to it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from router import errors
from router.fleet.membership import ADMIN, backend_from_admin
from router.fleet.registry import BackendState
from router.server.respond import error_response, json_response

if TYPE_CHECKING:
    from router.server.services import FleetAdmin


def backend_view(s: BackendState) -> dict[str, Any]:
    return {
        "name": s.config.name,
        "url": s.config.url,
        "role": s.config.role,
        "models": list(s.models),
        "healthy": s.healthy,
        "breaker": s.breaker,
        "draining": s.draining,
        "inflight": s.inflight,
        "running": s.running,
        "waiting": s.waiting,
        "kv_usage": s.kv_usage,
        "consecutive_failures": s.consecutive_failures,
        "last_error": s.last_error,
    }


class AdminApi:
    """The admin routes over the fleet."""

    def __init__(self, state: FleetAdmin):
        self.state = state

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/admin/backends", self.handle_list)
        router.add_post("/admin/backends", self.handle_add)
        router.add_delete("/admin/backends/{name}", self.handle_remove)
        router.add_post("/admin/backends/{name}/drain", functools.partial(self.handle_drain, draining=True))
        router.add_post("/admin/backends/{name}/enable", functools.partial(self.handle_drain, draining=False))

    def _refusal(self, request: web.Request) -> web.Response | None:
        refused = self.state.keys.admin_refusal(request.headers)
        return None if refused is None else error_response(refused)

    def _fleet_view(self, s: BackendState) -> dict[str, Any]:
        name, fleet = s.config.name, self.state.fleet
        return {
            **backend_view(s),
            "source": fleet.owner.get(name) if fleet else None,
            "removing": fleet.removing(name) if fleet else False,
        }

    def _unknown(self, name: str, listed_as: str) -> web.Response:
        registry = self.state.registry
        assert registry is not None
        return error_response(
            errors.RouterError(
                404, f"No backend named {name!r}; {listed_as}: {', '.join(registry.states)}.", param="name"
            )
        )

    async def handle_list(self, request: web.Request) -> web.Response:
        registry = self.state.registry
        assert registry is not None
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        return json_response([self._fleet_view(s) for s in registry.states.values()])

    async def handle_drain(self, request: web.Request, draining: bool) -> web.Response:
        """Take a backend out of rotation (requests it is serving finish) or put it back."""
        registry, fleet = self.state.registry, self.state.fleet
        assert registry is not None
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        name = request.match_info["name"]
        state = registry.states.get(name)
        if state is None:
            return self._unknown(name, "configured")
        if not draining and fleet is not None and fleet.removing(name):
            return error_response(
                errors.RouterError(409, f"Backend {name!r} is being removed; add it again instead.", param="name")
            )
        if fleet is not None:
            fleet.drain(name, draining)  # held across a replacement of the name
        else:
            registry.set_draining(name, draining)
        return json_response(backend_view(state))

    async def handle_add(self, request: web.Request) -> web.Response:
        """A new backend, in rotation once its health check passes (201 with its state)."""
        registry, fleet = self.state.registry, self.state.fleet
        assert registry is not None
        assert fleet is not None
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        try:
            config = backend_from_admin(orjson.loads(await request.read()))
        except orjson.JSONDecodeError:
            return error_response(errors.bad_request("The body is not valid JSON."))
        except errors.RouterError as e:
            return error_response(e)
        if config.name in registry.states and not (
            fleet.removing(config.name) and registry.states[config.name].config == config
        ):
            return error_response(
                errors.RouterError(409, f"A backend named {config.name!r} already exists.", param="name")
            )
        state = await fleet.add(config, ADMIN)
        return json_response(self._fleet_view(state), status=201)

    async def handle_remove(self, request: web.Request) -> web.Response:
        """Drained now (no new requests), forgotten once the requests it serves have
        finished (202; GET /admin/backends shows it until then)."""
        registry, fleet = self.state.registry, self.state.fleet
        assert registry is not None
        assert fleet is not None
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        name = request.match_info["name"]
        state = registry.states.get(name)
        if state is None:
            return self._unknown(name, "known")
        fleet.remove(name)
        return json_response(self._fleet_view(state), status=202)
