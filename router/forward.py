"""vLLM's other routes, forwarded whole to one engine that serves the body's model.

Everything but the generation routes (which race, fall back and resume: dispatch.py) is
answered by one engine: embeddings, pooling, classify, score and rerank, tokenize and
detokenize, the Responses API, audio transcription and translation, `/version`. The
router keeps its guarantees on them: authentication, the concurrency limit and body
limits, only healthy backends (the least loaded that serves the body's `model`), and
retries on another backend for failures before the answer's first byte (no connection,
an HTTP 5xx, silence). The engine's answer is streamed back as it comes: status, body and
content type unchanged (an SSE stream of `/v1/responses` included), so a client sees
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
from typing import Any, TYPE_CHECKING, AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from . import errors
from .admission import ID_PREFIX, RequestSpec
from .snapshot import ClusterSnapshot
from .metrics import RequestRecord
from .names import Route
from .request_body import FORM_BOUNDARY, check_length, read_body, read_form_prefix
from . import tracing
from .trace_context import client_request_id

if TYPE_CHECKING:
    from .app import RouterState

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
    "/v1/responses",
)
MULTIPART_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")
GET_ROUTES = ("/version", "/tokenizer_info")
STORED_RESPONSE_ROUTES = (("GET", "/v1/responses/{response_id}"), ("POST", "/v1/responses/{response_id}/cancel"))

# Answer headers passed back to the client (the rest are hop-by-hop or the router's own).
_ANSWER_HEADERS = ("Content-Type", "Content-Disposition", "Cache-Control", "metadata")
# Statuses worth another engine: the engine failed, not the request.
_RETRY_STATUSES = frozenset((500, 502, 503, 504))


def least_loaded(snapshot: ClusterSnapshot, model: str | None, exclude: frozenset[str]) -> str | None:
    """The available engine serving `model` with the least load, not in `exclude`."""
    candidates = [b for b in snapshot.decoders(model) if b.name not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda b: (b.load, b.inflight, b.name)).name


class _UploadTooLarge(Exception):
    pass


class Forwarder:
    """Serves the forwarded routes of one running router (`RouterState`)."""

    def __init__(self, state: "RouterState"):
        self.state = state

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
        async def serve(rec: RequestRecord) -> web.StreamResponse:
            raw = await read_body(request, self.state.config.server)
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise errors.bad_request(f"Request body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise errors.bad_request("Request body must be a JSON object.")
            model = body.get("model")
            if model is not None and not isinstance(model, str):
                raise errors.bad_request("`model` must be a string.", "model")
            rec.model = model
            rec.stream = body.get("stream") is True
            return await self._forward(request, rec, self._check_model(model), raw, "application/json")

        return await self._run(request, serve, need_slot=True)

    async def handle_upload(self, request: web.Request) -> web.StreamResponse:
        async def serve(rec: RequestRecord) -> web.StreamResponse:
            limit = self.state.config.server.max_upload_bytes
            if request.content_length is not None and request.content_length > limit:
                raise errors.payload_too_large(limit)
            ctype = request.headers.get("Content-Type", "")
            m = FORM_BOUNDARY.search(ctype)
            if not ctype.lower().startswith("multipart/form-data") or m is None:
                raise errors.bad_request("Expected a multipart/form-data body with a boundary.")
            prefix, model = await read_form_prefix(request, m.group(1).encode(), self.state.config.server)
            rec.model = model
            return await self._forward(
                request, rec, self._check_model(model), prefix, ctype, rest=request.content, limit=limit
            )

        return await self._run(request, serve, need_slot=True)

    async def handle_get(self, request: web.Request) -> web.StreamResponse:
        async def serve(rec: RequestRecord) -> web.StreamResponse:
            return await self._forward(request, rec, None, None, None)

        return await self._run(request, serve, need_slot=False)

    async def handle_stored_response(self, request: web.Request) -> web.StreamResponse:
        async def serve(rec: RequestRecord) -> web.StreamResponse:
            body = await read_body(request, self.state.config.server) if request.method == "POST" else None
            return await self._forward(request, rec, None, body, "application/json" if body else None, find=True)

        return await self._run(request, serve, need_slot=True)

    async def forward_generation(
        self, request: web.Request, spec: RequestSpec, rec: RequestRecord, answer_id: str
    ) -> web.StreamResponse:
        """A generation answered whole by one engine (`spec.whole`): vLLM's own answer."""
        dispatcher = self.state.dispatcher
        assert dispatcher is not None

        async def choose(exclude: frozenset[str]) -> tuple[str, int] | None:
            return await dispatcher.place_whole(spec, rec, exclude)

        # Explicit T = 0: an engine-wide default threshold must not reject the request. The
        # engine names its answer after the body's request_id (in the body: a client's id
        # need not be a valid header value), as the router would have.
        body = orjson.dumps(
            {
                **spec.body,
                "cache_hit_threshold": 0.0,
                "request_id": spec.request_id.removeprefix(ID_PREFIX[spec.endpoint]),
            }
        )
        rec.stream = spec.stream
        return await self._forward(
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
        self, request: web.Request, serve: Callable[[RequestRecord], Awaitable[web.StreamResponse]], need_slot: bool
    ) -> web.StreamResponse:
        state = self.state
        t0 = time.monotonic()
        rec = RequestRecord(request_id="", endpoint=request.path, model=None, stream=False)
        task = asyncio.current_task()
        if task is not None:
            state._handlers.add(task)
        state.request_began()
        try:
            tenant, priority = state.identify(request)
            rec.tenant = tenant.name
            header_id = client_request_id(request)
            rec.request_id = header_id or ""
            if need_slot:
                if request.path not in MULTIPART_ROUTES:  # uploads have their own limit
                    check_length(request, state.config.server)
                async with state.limiter.slot(tenant, priority):
                    return await serve(rec)
            return await serve(rec)
        except errors.RouterError as e:
            rec.status, rec.error = e.status, e.message
            if e.status == 429:
                state.metrics.rejected_overload.inc()
                if e.reason:
                    state.metrics.tenant_rejection(rec.tenant, e.reason)
            resp = web.Response(
                body=e.body_bytes(), status=e.status, content_type="application/json", headers=e.headers or None
            )
            if not request.content.is_eof():
                resp.force_close()  # refused before its body was read (see app.handle_generate)
            return resp
        except asyncio.CancelledError:
            rec.status, rec.error = 499, "client disconnected"
            raise
        except ConnectionResetError:
            rec.status, rec.error = 499, "client disconnected"
            raise
        finally:
            state.request_ended()
            if task is not None:
                state._handlers.discard(task)
            rec.duration_s = time.monotonic() - t0
            state.metrics.record(rec)

    def _check_model(self, model: str | None) -> str | None:
        """The model to route by; 404 in vLLM's words for one no backend serves."""
        registry = self.state.registry
        assert registry is not None  # routes are served only after start()
        served = registry.models()
        if model is not None and served and model not in served:
            raise errors.model_not_found(model, served)
        return model

    # --- upstream --------------------------------------------------------------------------
    async def _forward(
        self,
        request: web.Request,
        rec: RequestRecord,
        model: str | None,
        body: bytes | None,
        content_type: str | None,
        *,
        find: bool = False,
        rest: aiohttp.StreamReader | None = None,
        limit: int = 0,
        choose: Callable[[frozenset[str]], Awaitable[tuple[str, int] | None]] | None = None,
        request_id_header: bool = True,
        answer_id: str | None = None,
    ) -> web.StreamResponse:
        """`choose` (generations): the engine and the prompt tokens it will prefill, for the
        cost model's load (a `LegTicket`), instead of the least loaded engine."""
        state = self.state
        registry, client, timeouts = state.registry, state.client, state.config.timeouts
        assert registry is not None and client is not None  # routes are served only after start()
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeouts.total_s
        attempts = state.config.routing.max_retries + 1
        exclude: set[str] = set()
        last: tuple[int, bytes, dict[str, str]] | None = None  # the last engine's error answer
        last_problem = ""
        rest_started = [False]
        sent = [len(body or b"")]
        too_large = [False]  # aiohttp wraps what the body generator raises: a flag says it

        async def upload() -> AsyncIterator[bytes]:
            assert rest is not None  # an upload's body after its form prefix
            if body:
                yield body
            rest_started[0] = True
            timeout = state.config.server.body_timeout_s
            while True:
                async with asyncio.timeout(timeout):
                    data = await rest.readany()
                if not data:
                    return
                sent[0] += len(data)
                if sent[0] > limit:
                    too_large[0] = True
                    raise _UploadTooLarge()
                yield data

        while True:
            snap = registry.snapshot()
            tokens = None
            if find:
                names = [b.name for b in snap.decoders(None) if b.name not in exclude]
                name = names[0] if names else None
            elif choose is not None:
                name, tokens = await choose(frozenset(exclude)) or (None, None)
            else:
                name = least_loaded(snap, model, frozenset(exclude))
            if name is None or len(exclude) >= attempts and not find:
                break
            exclude.add(name)
            chosen = registry.states.get(name)
            if chosen is None:  # removed from the fleet while it was being chosen
                continue
            cfg = chosen.config
            leg, trace = tracing.start_leg(tracing.LEG_FORWARD, name, request.path)
            headers = {**trace, **({"Content-Type": content_type} if content_type else {})}
            if cfg.api_key:
                headers["Authorization"] = f"Bearer {cfg.api_key}"
            if request_id_header and rec.request_id:
                headers["X-Request-Id"] = rec.request_id
            data = upload() if rest is not None else body
            ticket = registry.open_leg(name, tokens) if tokens is not None else None
            if ticket is None:
                registry.acquire(name)
            resp: aiohttp.ClientResponse | None = None
            outcome = "failed"
            try:
                try:
                    async with asyncio.timeout_at(min(deadline, loop.time() + timeouts.first_token_s)):
                        resp = await client.session.request(
                            request.method, cfg.url + request.path_qs, data=data, headers=headers
                        )
                        first = b"" if resp.status in _RETRY_STATUSES else await resp.content.readany()
                        if ticket is not None:
                            registry.first_token(ticket)
                except (aiohttp.ClientError, ConnectionError, TimeoutError, _UploadTooLarge) as e:
                    if too_large[0]:
                        raise errors.payload_too_large(limit) from None
                    problem = "no answer in time" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
                    registry.record_failure(name, f"forward: {problem}")
                    state.metrics.upstream_errors.labels(name, "forward").inc()
                    last_problem = f"engine {name!r}: {problem}"
                    if resp is not None:
                        resp.close()
                    if rest_started[0]:  # part of the upload is gone: it cannot be sent again
                        raise errors.upstream_failed(name, problem) from None
                    rec.retries += 1
                    continue
                if resp.status in _RETRY_STATUSES and (find or len(exclude) < attempts) and not rest_started[0]:
                    err_body = await resp.content.read(64 * 1024)
                    last = (resp.status, err_body, _answer_headers(resp))
                    resp.release()
                    registry.record_failure(name, f"forward: HTTP {resp.status}")
                    state.metrics.upstream_errors.labels(name, "status").inc()
                    rec.retries += 1
                    continue
                if find and resp.status == 404:
                    last = (404, await resp.content.read(64 * 1024), _answer_headers(resp))
                    resp.release()
                    continue
                if resp.status < 500:
                    registry.record_success(name)
                route = Route.FORWARD if choose is None else rec.route or Route.DIRECT
                rec.route, rec.winner, rec.status = route, name, resp.status
                rec.legs.append(f"{route}:{name}")
                rec.ttft_s = loop.time() - started
                answer = await self._relay(request, rec, resp, first, deadline, answer_id)
                outcome = "done" if rec.status < 500 else f"HTTP {rec.status}"
                return answer
            finally:
                tracing.end_leg(leg, outcome, "" if outcome == "done" else outcome)
                if ticket is not None:
                    registry.close_leg(ticket)
                else:
                    registry.release(name)
                if resp is not None and not resp.closed:
                    resp.close()
        if last is not None:
            status, raw, hdrs = last
            rec.status = status
            return web.Response(status=status, body=raw, headers=self._answer_with_id(hdrs, rec, answer_id))
        if last_problem:
            raise errors.RouterError(502, f"No engine could answer: {last_problem}")
        raise errors.no_backend(model)

    def _answer_with_id(
        self, headers: dict[str, Any], rec: RequestRecord, answer_id: str | None = None
    ) -> dict[str, Any]:
        if answer_id or rec.request_id:
            headers["X-Request-Id"] = answer_id or rec.request_id
        return headers

    async def _relay(
        self,
        request: web.Request,
        rec: RequestRecord,
        resp: aiohttp.ClientResponse,
        first: bytes,
        deadline: float,
        answer_id: str | None = None,
    ) -> web.StreamResponse:
        """The engine's answer to the client as it arrives, within timeouts.idle_s between
        chunks and the request's total deadline. A failure from here on can only close the
        connection: the status is sent."""
        out = web.StreamResponse(
            status=resp.status, headers=self._answer_with_id(_answer_headers(resp), rec, answer_id)
        )
        if resp.content_length is not None and resp.content_length == len(first):
            out.content_length = resp.content_length
        await out.prepare(request)
        idle = self.state.config.timeouts.idle_s
        loop = asyncio.get_running_loop()
        data = first
        while data:
            await out.write(data)
            try:
                async with asyncio.timeout_at(min(deadline, loop.time() + idle)):
                    data = await resp.content.readany()
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                rec.status, rec.error = 502, f"answer cut short: {type(e).__name__}"
                log.warning("forwarded %s from %s: %s", request.path, rec.winner, rec.error)
                request.transport.close() if request.transport is not None else None
                return out
        await out.write_eof()
        return out


def _answer_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {h: resp.headers[h] for h in _ANSWER_HEADERS if h in resp.headers}
