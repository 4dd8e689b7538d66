"""The simulator's own routes: GET /_sim/state (white-box numbers) and GET/POST
/_sim/faults (runtime fault changes; 404 unless enable_admin)."""

from __future__ import annotations

import dataclasses

import orjson
from aiohttp import web

from .api_errors import ApiError
from .config import FaultConfig, SimEngineConfig
from .engine import SimEngine
from .json_answers import error_response, json_response


class AdminRoutes:
    """State and fault routes of one engine."""

    def __init__(self, config: SimEngineConfig, engine: SimEngine) -> None:
        self.config = config
        self.engine = engine

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/_sim/state", self._state)
        app.router.add_get("/_sim/faults", self._get_faults)
        app.router.add_post("/_sim/faults", self._set_faults)

    async def _state(self, request: web.Request) -> web.Response:
        return json_response(self.engine.snapshot())

    async def _get_faults(self, request: web.Request) -> web.Response:
        if not self.config.enable_admin:
            raise web.HTTPNotFound()
        return json_response(dataclasses.asdict(self.config.faults))

    async def _set_faults(self, request: web.Request) -> web.Response:
        if not self.config.enable_admin:
            raise web.HTTPNotFound()
        try:
            body = orjson.loads(await request.read())
            if not isinstance(body, dict):
                raise TypeError("expected a JSON object")
            current = dataclasses.asdict(self.config.faults)
            unknown = set(body) - set(current)
            if unknown:
                raise TypeError(f"unknown fault fields: {', '.join(sorted(unknown))}")
            for k, v in body.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError(f"{k}: expected a number")
                current[k] = type(current[k])(v)
            faults = FaultConfig(**current)
            faults.validate()
        except (orjson.JSONDecodeError, TypeError, ValueError) as e:
            return error_response(ApiError(str(e)))
        # Changed in place: the engines (each DP rank's config a copy of the server's) share
        # this one object, and a new one would reach the server's routes only.
        for k, v in dataclasses.asdict(faults).items():
            setattr(self.config.faults, k, v)
        return json_response(dataclasses.asdict(faults))


__all__ = ["AdminRoutes"]
