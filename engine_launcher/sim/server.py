"""The HTTP face of one simulated engine: vLLM 0.32's OpenAI routes plus the simulator's
own side channel and admin routes.

vLLM routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, GET /version, POST /reset_prefix_cache (a dev-mode route in vLLM, always on
here), POST /v1/embeddings, /tokenize, /detokenize, /v1/audio/* (aux_routes.py).
Simulator routes: POST /_sim/kv/pull (the KV side channel a consumer calls on the producer
named by remote_host/remote_port), GET /_sim/state (white-box numbers), GET/POST
/_sim/faults (runtime fault changes; 404 unless enable_admin).

A client that disconnects aborts its request, as in vLLM: the app runs with aiohttp's
handler cancellation on, and every generation handler aborts its engine request on the way
out unless it finished.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import logging
import os
import random
import socket
import time
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from . import multi
from . import responses as R
from .aux_routes import AuxRoutes
from .config import VLLM_VERSION, FaultConfig, SimEngineConfig
from .engine import SimEngine
from .protocol import ApiError, json_error, parse_request
from .request import SimRequest

log = logging.getLogger("engine_launcher.sim")

PULL_TIMEOUT_S = 10.0
# Graceful-shutdown bound for handlers still running when an engine closes.
SHUTDOWN_TIMEOUT_S = 5.0
LISTEN_BACKLOG = 4096


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


# vLLM's answer for a request that finished with FinishReason.ERROR (e.g. a failed KV load).
GENERATION_ERROR = ApiError("Internal server error", 500, "InternalServerError")


def _error(e: ApiError) -> web.Response:
    return _json(e.body(), e.status)


class SimServer:
    """One engine and its aiohttp application, listening on one port."""

    def __init__(self, config: SimEngineConfig, *, exit_process_on_fault: bool = False) -> None:
        # A private copy: engines built from one config (dataclasses.replace shares the
        # FaultConfig) must not share mutable state.
        config = copy.deepcopy(config)
        self.config = config
        self.engine = SimEngine(config)
        self.exit_process_on_fault = exit_process_on_fault
        self.fingerprint = "vllm-{}-{}".format(
            VLLM_VERSION,
            hashlib.sha256(f"{config.model}|{config.block_size}|{config.max_model_len}".encode()).hexdigest()[:8],
        )
        self.created = int(time.time())
        self._rng = random.Random(config.seed)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._active: set[asyncio.Task] = set()
        self._transports: set[asyncio.Transport] = set()
        self.host = ""
        self.port = 0
        self.app = self._make_app()

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load_lora)
        app.router.add_post("/v1/unload_lora_adapter", self._unload_lora)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        self.aux = AuxRoutes(self.config)  # /v1/embeddings, /tokenize, /detokenize, audio
        self.aux.add_to(app)
        app.router.add_post("/_sim/kv/pull", self._kv_pull)
        app.router.add_get("/_sim/state", self._state)
        app.router.add_get("/_sim/faults", self._get_faults)
        app.router.add_post("/_sim/faults", self._set_faults)
        return app

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind (port 0: a free port), start the engine loop, return the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setblocking(False)
        self.host = host
        self.port = sock.getsockname()[1]
        self.engine.side_channel_host = host if host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.engine.side_channel_port = self.port
        self.engine.pull_fn = self._pull_remote
        self.engine.on_fatal = self._on_fatal
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PULL_TIMEOUT_S))
        self.engine.start()
        # handler_cancellation: a client that goes away cancels its handler (vLLM aborts
        # the request when the client disconnects; the router relies on it).
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        await self._runner.setup()
        # A deep accept queue: a router or a benchmark may open hundreds of streams at once.
        site = web.SockSite(self._runner, sock, backlog=LISTEN_BACKLOG)
        await site.start()
        return self.port

    async def close(self) -> None:
        # The engine first: aborting every request lets open handlers finish their answers,
        # so the runner's graceful shutdown does not wait for long generations.
        await self.engine.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _on_fatal(self) -> None:
        """The exit fault: the process dies (CLI) or every connection drops (in-process)."""
        if self.exit_process_on_fault:
            log.error("fault injection: exiting the process")
            os._exit(3)
        for t in list(self._transports):
            t.abort()
        asyncio.get_running_loop().create_task(self._stop_listening())

    async def _stop_listening(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # --- generation ------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        cfg = self.config
        data = await request.read()
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError:
            return _error(json_error(data.decode("utf-8", errors="replace")))
        try:
            parsed = parse_request(raw, cfg, chat)
        except ApiError as e:
            return _error(e)
        if cfg.faults.error_rate and self._rng.random() < cfg.faults.error_rate:
            return _error(ApiError("Simulated engine failure (fault injection)", 500, "InternalServerError"))
        if self.engine.dead:
            return _error(ApiError("The engine is dead", 500, "InternalServerError"))
        if not parsed.single:
            return await self._generate_choices(request, parsed)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        req = SimRequest(rid, parsed.prompt_ids, parsed.sampling, parsed.threshold, parsed.kv_transfer_params)
        ctx = R.ResponseContext(rid, int(time.time()), parsed.model, self.fingerprint, parsed)
        transport = request.transport
        if transport is not None:
            self._transports.add(transport)
        self.engine.add_request(req)
        try:
            if parsed.stream:
                return await self._stream(request, ctx, req)
            while not req.finished:
                await req.event.wait()
                req.event.clear()
            if req.finish_reason == "error":
                return _error(GENERATION_ERROR)
            return web.Response(
                body=R.full_response(ctx, req, req.output_text, cfg.enable_prompt_tokens_details),
                content_type="application/json",
            )
        finally:
            if not req.finished:
                self.engine.abort(rid)
            if transport is not None:
                self._transports.discard(transport)

    async def _generate_choices(self, request: web.Request, parsed) -> web.StreamResponse:
        """Batches, n > 1, echo, prompt_logprobs: one engine request per choice (multi.py),
        the answer named after X-Request-Id, else the body's request_id, as vLLM names it."""
        name = request.headers.get("X-Request-Id") or parsed.request_id or uuid.uuid4().hex
        rid = f"{'chatcmpl' if parsed.chat else 'cmpl'}-{name}"
        ctx = R.ResponseContext(rid, int(time.time()), parsed.model, self.fingerprint, parsed)
        reqs = multi.choice_requests(parsed, f"{rid}-{uuid.uuid4().hex}")
        details = self.config.enable_prompt_tokens_details
        for _, req in reqs:
            self.engine.add_request(req)
        try:
            if parsed.stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
                try:
                    await multi.write_stream(
                        request, resp, ctx, reqs, details, b"data: " + orjson.dumps(GENERATION_ERROR.body()) + b"\n\n"
                    )
                except ConnectionResetError:
                    log.debug("client of %s disconnected", rid)
                return resp
            for _, req in reqs:
                while not req.finished:
                    await req.event.wait()
                    req.event.clear()
            if any(req.finish_reason == "error" for _, req in reqs):
                return _error(GENERATION_ERROR)
            return web.Response(body=multi.full_answer(ctx, reqs, details), content_type="application/json")
        finally:
            for _, req in reqs:
                if not req.finished:
                    self.engine.abort(req.request_id)

    async def _stream(self, request: web.Request, ctx: R.ResponseContext, req: SimRequest) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        try:
            await self._write_stream(request, resp, ctx, req)
        except ConnectionResetError:
            # The client went away between two chunks; the caller aborts the request.
            log.debug("client of %s disconnected", req.request_id)
        return resp

    async def _write_stream(
        self, request: web.Request, resp: web.StreamResponse, ctx: R.ResponseContext, req: SimRequest
    ) -> None:
        cfg = self.config
        details = cfg.enable_prompt_tokens_details
        await resp.prepare(request)
        if ctx.chat:
            await resp.write(R.chat_role_chunk(ctx, req))
        state = R.CompletionStreamState()
        sent = 0
        stalled = False
        while True:
            await req.event.wait()
            req.event.clear()
            ids, text, lps = req.drain()
            finished = req.finished
            if finished and req.finish_reason == "error":
                # vLLM's GenerationError in a stream: one error event, then [DONE].
                await resp.write(b"data: " + orjson.dumps(GENERATION_ERROR.body()) + b"\n\n")
                await resp.write(R.SSE_DONE)
                await resp.write_eof()
                return
            # vLLM sends no chunk for a step without text or tokens unless it finishes.
            if ids or text or finished:
                await resp.write(
                    R.stream_chunk(
                        ctx,
                        req,
                        state,
                        ids,
                        text,
                        lps,
                        req.finish_reason if finished else None,
                        req.stop_reason if finished else None,
                    )
                )
                sent += len(ids)
            if finished:
                break
            faults = cfg.faults
            if faults.stall_after_tokens and not stalled and sent >= faults.stall_after_tokens:
                stalled = True
                await asyncio.sleep(faults.stall_seconds)
        if ctx.parsed.include_usage:
            await resp.write(R.usage_chunk(ctx, req, details))
        await resp.write(R.SSE_DONE)
        await resp.write_eof()

    # --- NIXL-like side channel ------------------------------------------------------

    async def _pull_remote(self, params: dict, num_tokens: int) -> bool:
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

    async def _kv_pull(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
            rid = str(body["remote_request_id"])
            eid = str(body["remote_engine_id"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return _error(ApiError("expected remote_request_id and remote_engine_id"))
        ok, message, n = self.engine.serve_pull(rid, eid)
        if not ok:
            return _error(ApiError(message, 404, "NotFoundError"))
        return _json({"ok": True, "num_tokens": n})

    # --- other routes ------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        """The base model, then each LoRA adapter (vLLM's ModelCard: an adapter's root is
        its path, its parent the base model, its max_model_len null)."""
        m = self.config.model

        def card(id_: str, root: str, parent: str | None, max_len: int | None) -> dict:
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

        return _json(
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
            return _error(ApiError("Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput"))
        if name == self.config.model:
            return _error(
                ApiError(f"The lora adapter '{name}' conflicts with a served base model.", 400, "InvalidUserInput")
            )
        if name in self.config.lora_modules and not body.get("load_inplace"):
            return _error(
                ApiError(
                    f"The lora adapter '{name}' has already been loaded. If you want to "
                    "load the adapter in place, set 'load_inplace' to True.",
                    400,
                    "InvalidUserInput",
                )
            )
        self.config.lora_modules[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            body = None
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not name:
            return _error(
                ApiError("'lora_name' needs to be provided to unload a LoRA adapter.", 400, "InvalidUserInput")
            )
        if self.config.lora_modules.pop(name, None) is None:
            return _error(ApiError(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError"))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _health(self, request: web.Request) -> web.Response:
        if self.engine.dead:
            return web.Response(status=503)
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": VLLM_VERSION})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.engine.refresh_gauges()
        return web.Response(body=self.engine.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return _json({"success": self.engine.reset_prefix_cache()})

    async def _state(self, request: web.Request) -> web.Response:
        return _json(self.engine.snapshot())

    async def _get_faults(self, request: web.Request) -> web.Response:
        if not self.config.enable_admin:
            raise web.HTTPNotFound()
        return _json(dataclasses.asdict(self.config.faults))

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
            return _error(ApiError(str(e)))
        self.config.faults = faults
        return _json(dataclasses.asdict(faults))
