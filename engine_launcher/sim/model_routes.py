"""The simulator's model routes, in vLLM 0.32's JSON: GET /v1/models (the base model,
then each LoRA adapter) and POST /v1/load_lora_adapter, /v1/unload_lora_adapter (the
adapters are names only: nothing is loaded; a load takes `lora_load_s`)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import orjson
from aiohttp import web

from .api_errors import ApiError
from .config import SimEngineConfig
from .json_answers import error_response, json_response


class ModelRoutes:
    """The model list and LoRA adapter routes of one engine (its config's lora_modules)."""

    def __init__(self, config: SimEngineConfig, created: int) -> None:
        self.config = config
        self.created = created

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load_lora)
        app.router.add_post("/v1/unload_lora_adapter", self._unload_lora)

    async def _models(self, request: web.Request) -> web.Response:
        """The base model, then each LoRA adapter (vLLM's ModelCard: an adapter's root is
        its path, its parent the base model, its max_model_len null)."""
        m = self.config.model

        def card(id_: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
            return {
                "id": id_,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, id_).hex}",
                        "object": "model_permission",
                        "created": self.created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }

        return json_response(
            {
                "object": "list",
                "data": [card(m, m, None, self.config.max_model_len)]
                + [card(name, path, m, None) for name, path in self.config.lora_modules.items()],
            }
        )

    async def _load_lora(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/load_lora_adapter: 200 with a text answer, errors in its words."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            body = None
        name = body.get("lora_name") if isinstance(body, dict) else None
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not name or not path:
            return error_response(
                ApiError("Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput")
            )
        if name == self.config.model:
            return error_response(
                ApiError(f"The lora adapter '{name}' conflicts with a served base model.", 400, "InvalidUserInput")
            )
        if name in self.config.lora_modules and not body.get("load_inplace"):
            return error_response(
                ApiError(
                    f"The lora adapter '{name}' has already been loaded. If you want to "
                    "load the adapter in place, set 'load_inplace' to True.",
                    400,
                    "InvalidUserInput",
                )
            )
        if self.config.lora_load_s > 0:  # the weights read from disk
            await asyncio.sleep(self.config.lora_load_s / self.config.speed)
        self.config.lora_modules[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            body = None
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not name:
            return error_response(
                ApiError("'lora_name' needs to be provided to unload a LoRA adapter.", 400, "InvalidUserInput")
            )
        if self.config.lora_modules.pop(name, None) is None:
            return error_response(ApiError(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError"))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


__all__ = ["ModelRoutes"]
