"""vLLM's other routes, forwarded whole to one engine that serves the body's model.

Everything but the generation routes (which race, fall back and resume: dispatch.py) is
answered by one engine: embeddings, pooling, classify, score and rerank, tokenize and
detokenize, the Anthropic API's `/v1/messages/count_tokens`, audio transcription and
translation, `/version` (the Responses API is placed like a generation:
router/server/responses.py). The router keeps its guarantees on them: the same admission
as a generation for every route, GET included (the key, the tenant's rate, a concurrency
slot), body limits, a JSON body
with the router's fields removed and its `priority` checked against the key's rule
(router/admission/engine_body.py; sent as the client's bytes when nothing was removed),
only healthy backends (the least loaded that serves the body's `model`), and
retries on another backend for failures before the answer's first byte (no connection,
an HTTP 5xx, silence: router/server/relay.py). The engine's answer is streamed back as it comes: status, body and
content type unchanged, so a client sees
vLLM's own JSON and errors.

Audio uploads (multipart/form-data) are never buffered whole: the router reads only the
form fields before the file part (where the OpenAI SDK and most clients put `model`) and
streams the rest upstream as it arrives, within `server.max_upload_bytes`. Such a body can
be sent once: an upload is retried elsewhere only if the engine refused the connection
before reading any of it.

Generation requests only an engine can answer whole (n > 1, batched prompts, echo,
prompt_logprobs, beam search: admission.py) take the same path to the engine
`Dispatcher.place_whole` picks (the strategy's choice; when it races, the winner of a race
of one-token probes), with the client's body minus the router's internal fields.

`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` concern a response stored in
one engine's memory: every engine that could hold it is asked in turn until one does not
answer 404.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from router import errors
from router.admission.body import (
    FORM_BOUNDARY,
    BodyReader,
    body_reservation,
    check_length,
    read_body,
    read_form_prefix,
    read_json_object,
)
from router.admission.engine_body import engine_json
from router.admission.spec import ID_PREFIX, RequestSpec
from router.admission.tenants import Tenant
from router.engine.wire import whole_request_body
from router.observability.record import RequestRecord
from router.observability.trace_context import client_request_id
from router.server.relay import EngineRelay

if TYPE_CHECKING:
    from router.server.services import Forwarding

log = logging.getLogger("cachehit_router.forward")


# POST routes with a JSON body, as vLLM 0.32's OpenAI server registers them.
JSON_ROUTES = (
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/tokenize",
    "/detokenize",
    "/v1/messages/count_tokens",  # the Anthropic API's token count (its messages: messages.py)
)
MULTIPART_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")
GET_ROUTES = ("/version", "/tokenizer_info")
STORED_RESPONSE_ROUTES = (("GET", "/v1/responses/{response_id}"), ("POST", "/v1/responses/{response_id}/cancel"))


class Forwarder:
    """Serves the forwarded routes."""

    def __init__(self, state: Forwarding):
        self.state = state
        self.relay = EngineRelay(state)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        for path in JSON_ROUTES:
            router.add_post(path, self.handle_json)
        for path in MULTIPART_ROUTES:
            router.add_post(path, self.handle_upload)
        for path in GET_ROUTES:
            router.add_get(path, self.handle_get)
        for method, path in STORED_RESPONSE_ROUTES:
            router.add_route(method, path, self.handle_stored_response)

    # --- handlers ----------------------------------------------------------------------
    async def handle_json(self, request: web.Request) -> web.StreamResponse:
        async def serve(rec: RequestRecord, tenant: Tenant) -> web.StreamResponse:
            raw, body, model = await read_json_object(request, self.state.config.server)
            rec.model = model
            rec.stream = body.get("stream") is True
            sent = engine_json(raw, body, tenant)  # the router's fields stripped, priority checked
            del raw, body  # only what is sent is kept while the engine answers
            return await self.relay.forward(request, rec, self._check_model(model), sent, "application/json")

        return await self._run(request, serve)

    async def handle_upload(self, request: web.Request) -> web.StreamResponse:
        async def serve(rec: RequestRecord, tenant: Tenant) -> web.StreamResponse:
            limit = self.state.config.server.max_upload_bytes
            if request.content_length is not None and request.content_length > limit:
                raise errors.payload_too_large(limit)
            ctype = request.headers.get("Content-Type", "")
            m = FORM_BOUNDARY.search(ctype)
            if not ctype.lower().startswith("multipart/form-data") or m is None:
                raise errors.bad_request("Expected a multipart/form-data body with a boundary.")
            # One deadline for the whole upload: its form fields and the file streamed on.
            reader = BodyReader(request, self.state.config.server)
            prefix, model = await read_form_prefix(reader, m.group(1).encode())
            rec.model = model
            return await self.relay.forward(
                request, rec, self._check_model(model), prefix, ctype, rest=reader, limit=limit
            )

        return await self._run(request, serve)

    async def handle_get(self, request: web.Request) -> web.StreamResponse:
        async def serve(rec: RequestRecord, tenant: Tenant) -> web.StreamResponse:
            return await self.relay.forward(request, rec, None, None, None)

        return await self._run(request, serve)

    async def handle_stored_response(self, request: web.Request) -> web.StreamResponse:
        async def serve(rec: RequestRecord, tenant: Tenant) -> web.StreamResponse:
            # vLLM reads no body on these routes (the response's id is in the path).
            body = await read_body(request, self.state.config.server) if request.method == "POST" else None
            return await self.relay.forward(request, rec, None, body, "application/json" if body else None, find=True)

        return await self._run(request, serve)

    async def forward_generation(
        self, request: web.Request, spec: RequestSpec, rec: RequestRecord, answer_id: str
    ) -> web.StreamResponse:
        """A generation answered whole by one engine (`spec.whole`): vLLM's own answer."""
        dispatcher = self.state.dispatcher
        assert dispatcher is not None

        async def choose(exclude: frozenset[str]) -> tuple[str, int] | None:
            return await dispatcher.place_whole(spec, rec, exclude)

        body = orjson.dumps(whole_request_body(spec.body, spec.request_id.removeprefix(ID_PREFIX[spec.endpoint])))
        rec.stream = spec.stream
        return await self.relay.forward(
            request,
            rec,
            spec.model,
            body,
            "application/json",
            choose=choose,
            request_id_header=False,
            answer_id=answer_id,
        )

    # --- the frame shared by every route ---------------------------------------------------
    async def _run(
        self, request: web.Request, serve: Callable[[RequestRecord, Tenant], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every forwarded route, GET included, is admitted as a generation is: the key, the
        tenant's rate, a concurrency slot (queued fairly)."""
        state = self.state
        t0 = time.monotonic()
        rec = RequestRecord(request_id="", endpoint=request.path, model=None, stream=False)
        task = state.request_began()
        try:
            tenant, priority = state.identify(request)
            rec.tenant = tenant.name
            header_id = client_request_id(request)
            rec.request_id = header_id or ""
            if request.path not in MULTIPART_ROUTES:  # uploads have their own limit
                check_length(request, state.config.server)
            # Uploads stream (never held whole): only bodies read whole count in the budget.
            held = 0 if request.path in MULTIPART_ROUTES else body_reservation(request, state.config.server)
            async with state.limiter.slot(tenant, priority), state.body_budget.hold(held):
                return await serve(rec, tenant)
        except errors.RouterError as e:
            resp = state.refused(rec, e)
            if not request.content.is_eof():
                resp.force_close()  # refused before its body was read (see generation.py)
            return resp
        except asyncio.CancelledError:
            rec.status, rec.error = 499, "client disconnected"
            raise
        except ConnectionResetError:
            rec.status, rec.error = 499, "client disconnected"
            raise
        finally:
            state.request_ended(task)
            rec.duration_s = time.monotonic() - t0
            state.metrics.record(rec)

    async def admitted(
        self, request: web.Request, serve: Callable[[RequestRecord, Tenant], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The admission frame of these routes around a route served elsewhere
        (`/v1/responses`: router/server/responses.py)."""
        return await self._run(request, serve)

    def check_model(self, model: str | None) -> str | None:
        return self._check_model(model)

    def _check_model(self, model: str | None) -> str | None:
        """The model to route by; 404 in vLLM's words for one no backend serves."""
        registry = self.state.registry
        assert registry is not None  # routes are served only after start()
        served = registry.models()
        if model is not None and served and model not in served:
            raise errors.model_not_found(model, served)
        return model

    # --- upstream --------------------------------------------------------------------------
