"""The HTTP face of one simulated engine: vLLM 0.32's OpenAI routes plus the simulator's
own side channel and admin routes; the generation routes are served here.

vLLM routes: POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics,
GET /version, POST /reset_prefix_cache (a dev-mode route in vLLM, always on here);
GET /v1/models and the LoRA adapter routes (model_routes.py); POST /v1/embeddings,
/tokenize, /detokenize, /v1/audio/* (aux_routes.py).
Simulator routes: POST /_sim/kv/pull (kv_side_channel.py), GET /_sim/state and GET/POST
/_sim/faults (admin_routes.py).

A client that disconnects aborts its request, as in vLLM: the app runs with aiohttp's
handler cancellation on, and every generation handler aborts its engine request on the way
out unless it finished.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import os
import random
import socket
import time
import uuid

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import multi
from . import responses as R
from .admin_routes import AdminRoutes
from .api_errors import ApiError, json_error
from .aux_routes import AuxRoutes
from .config import VLLM_VERSION, SimEngineConfig
from .data_parallel import MergedRegistry, RankPicker, rank_configs
from .engine import SimEngine
from .json_answers import error_response, json_response
from .kv_side_channel import KvSideChannel
from .model_routes import ModelRoutes
from .protocol import ParsedRequest, parse_request
from .request import SimRequest
from .responses_route import serve_responses

log = logging.getLogger("engine_launcher.sim")

# Graceful-shutdown bound for handlers still running when an engine closes.
SHUTDOWN_TIMEOUT_S = 5.0
LISTEN_BACKLOG = 4096


# vLLM's answer for a request that finished with FinishReason.ERROR (e.g. a failed KV load).
GENERATION_ERROR = ApiError("Internal server error", 500, "InternalServerError")


class SimServer:
    """One engine and its aiohttp application, listening on one port."""

    def __init__(self, config: SimEngineConfig, *, exit_process_on_fault: bool = False) -> None:
        # A private copy: engines built from one config (dataclasses.replace shares the
        # FaultConfig) must not share mutable state.
        config = copy.deepcopy(config)
        self.config = config
        # One engine core per DP rank (data_parallel.py); rank 0 also serves the side
        # channel's pulls and the admin routes.
        self.engines = [SimEngine(c) for c in rank_configs(config)]
        self.engine = self.engines[0]
        self.ranks = RankPicker(self.engines)
        self._merged_metrics = MergedRegistry(self.engines)
        self.exit_process_on_fault = exit_process_on_fault
        self.fingerprint = "vllm-{}-{}".format(
            VLLM_VERSION,
            hashlib.sha256(f"{config.model}|{config.block_size}|{config.max_model_len}".encode()).hexdigest()[:8],
        )
        self.created = int(time.time())
        self._rng = random.Random(config.seed)
        self._runner: web.AppRunner | None = None
        self.side_channel = KvSideChannel(self.engine)
        self._active: set[asyncio.Task[None]] = set()
        self._transports: set[asyncio.Transport] = set()
        self.host = ""
        self.port = 0
        self.app = self._make_app()

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/responses", self._responses)
        ModelRoutes(self.config, self.created).add_to(app)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        self.aux = AuxRoutes(self.config)  # /v1/embeddings, /tokenize, /detokenize, audio
        self.aux.add_to(app)
        self.side_channel.add_to(app)
        AdminRoutes(self.config, self.engine).add_to(app)
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
        for engine in self.engines:
            engine.side_channel_host = host if host not in ("0.0.0.0", "::") else "127.0.0.1"
            engine.side_channel_port = self.port
            engine.pull_fn = self.side_channel.pull
            engine.on_fatal = self._on_fatal
        self.side_channel.open()
        for engine in self.engines:
            engine.start()
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
        for engine in self.engines:
            await engine.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.side_channel.close()

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
            return error_response(json_error(data.decode("utf-8", errors="replace")))
        try:
            parsed = parse_request(raw, cfg, chat)
        except ApiError as e:
            return error_response(e)
        if cfg.faults.error_rate and self._rng.random() < cfg.faults.error_rate:
            return error_response(ApiError("Simulated engine failure (fault injection)", 500, "InternalServerError"))
        try:
            engine = self.ranks.pick(request.headers)
        except ApiError as e:
            return error_response(e)
        if engine.dead:
            return error_response(ApiError("The engine is dead", 500, "InternalServerError"))
        if not parsed.single:
            return await self._generate_choices(request, parsed, engine)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        req = SimRequest(rid, parsed.prompt_ids, parsed.sampling, parsed.threshold, parsed.kv_transfer_params)
        req.lora_name = self._lora_name(parsed.model)
        ctx = R.ResponseContext(rid, int(time.time()), parsed.model, self.fingerprint, parsed)
        transport = request.transport
        if transport is not None:
            self._transports.add(transport)
        engine.add_request(req)
        try:
            if parsed.stream:
                return await self._stream(request, ctx, req)
            while not req.finished:
                await req.event.wait()
                req.event.clear()
            if req.finish_reason == "error":
                return error_response(GENERATION_ERROR)
            return web.Response(
                body=R.full_response(ctx, req, req.output_text, cfg.enable_prompt_tokens_details),
                content_type="application/json",
            )
        finally:
            if not req.finished:
                engine.abort(rid)
            if transport is not None:
                self._transports.discard(transport)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API as the chat request it stands for (responses_route.py)."""
        return await serve_responses(request, self.config, self.ranks)

    async def _generate_choices(
        self, request: web.Request, parsed: ParsedRequest, engine: SimEngine
    ) -> web.StreamResponse:
        """Batches, n > 1, echo, prompt_logprobs: one engine request per choice (multi.py),
        the answer named after X-Request-Id, else the body's request_id, as vLLM names it."""
        name = request.headers.get("X-Request-Id") or parsed.request_id or uuid.uuid4().hex
        rid = f"{'chatcmpl' if parsed.chat else 'cmpl'}-{name}"
        ctx = R.ResponseContext(rid, int(time.time()), parsed.model, self.fingerprint, parsed)
        reqs = multi.choice_requests(parsed, f"{rid}-{uuid.uuid4().hex}")
        details = self.config.enable_prompt_tokens_details
        for _, req in reqs:
            req.lora_name = self._lora_name(parsed.model)
            engine.add_request(req)
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
                return error_response(GENERATION_ERROR)
            return web.Response(body=multi.full_answer(ctx, reqs, details), content_type="application/json")
        finally:
            for _, req in reqs:
                if not req.finished:
                    engine.abort(req.request_id)

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

    # --- other routes ------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if any(engine.dead for engine in self.engines):
            return web.Response(status=503)
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return json_response({"version": VLLM_VERSION})

    async def _metrics(self, request: web.Request) -> web.Response:
        for engine in self.engines:
            engine.refresh_gauges()
        # One rank: its own registry; several: one exposition of all (engine="<rank>").
        merged = self._merged_metrics
        body = self.engine.metrics.render() if len(self.engines) == 1 else generate_latest(merged)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _lora_name(self, model: str) -> str | None:
        """The adapter a request names (None: the base model)."""
        return None if model == self.config.model else model

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return json_response({"success": all([engine.reset_prefix_cache() for engine in self.engines])})
