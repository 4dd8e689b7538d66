"""The simulator's stand-in for NIXL's side channel: a consumer asks the producer named
by remote_host/remote_port to hand over a finished prefill's blocks (POST /_sim/kv/pull),
and the producer releases its lease on them (SimEngine.serve_pull)."""

from __future__ import annotations

import logging

import aiohttp
import orjson
from aiohttp import web

from .api_errors import ApiError
from .engine import SimEngine
from .json_answers import error_response, json_response
from .request import KvParams

log = logging.getLogger("engine_launcher.sim")

PULL_TIMEOUT_S = 10.0


class KvSideChannel:
    """Both ends of one engine's side channel: its client (`pull`) and its route."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self._session: aiohttp.ClientSession | None = None

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/_sim/kv/pull", self._serve_pull)

    def open(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PULL_TIMEOUT_S))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def pull(self, params: KvParams, num_tokens: int) -> bool:
        """Consumer side: ask the producer named in the params to hand over the blocks."""
        host, port = params.get("remote_host"), params.get("remote_port")
        if not host or not port or self._session is None:
            return False
        if ":" in str(host) and not str(host).startswith("["):
            host = f"[{host}]"
        try:
            async with self._session.post(
                f"http://{host}:{port}/_sim/kv/pull",
                json={
                    "remote_engine_id": params.get("remote_engine_id"),
                    "remote_request_id": params.get("remote_request_id"),
                    "remote_block_ids": params.get("remote_block_ids"),
                    "num_tokens": num_tokens,
                },
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning("KV pull from %s:%s failed: %s", host, port, e)
            return False

    async def _serve_pull(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
            rid = str(body["remote_request_id"])
            eid = str(body["remote_engine_id"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return error_response(ApiError("expected remote_request_id and remote_engine_id"))
        ok, message, n = self.engine.serve_pull(rid, eid)
        if not ok:
            return error_response(ApiError(message, 404, "NotFoundError"))
        return json_response({"ok": True, "num_tokens": n})


__all__ = ["PULL_TIMEOUT_S", "KvSideChannel"]
