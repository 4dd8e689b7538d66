"""The generation routes, `/v1/completions` and `/v1/chat/completions`: one client request
from its admission to its last byte.

The request is authenticated and holds a concurrency slot before its body is read; the
body becomes a `RequestSpec` (router/admission/spec.py); the dispatcher carries it from plan to
last leg (router/dispatch/pipeline.py) while the shaper rewrites what the engines send into one
answer, streamed (router/server/respond.py) or whole. Requests only an engine can answer whole
(n > 1, batches, echo, prompt_logprobs) go to router/server/forward.py. Every way a request can
end (an error before or after the first byte, a client that hangs up or stops reading,
the shutdown's drain running out, a router bug) gets its answer here and its record in
the metrics and the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from aiohttp import web

from router import errors
from router.admission.body import body_reservation, check_length, read_body
from router.admission.engine_body import check_priority
from router.admission.spec import parse_request
from router.admission.tenants import Tenant
from router.answer.shaper import ResponseShaper
from router.observability.clientlog import escape
from router.observability.record import RequestRecord
from router.observability.trace_context import answer_request_id, client_request_id
from router.server.respond import ClientStalled, EventFraming, SSEWriter, error_response, json_response

if TYPE_CHECKING:
    from router.server.forward import Forwarder
    from router.server.services import Admission

log = logging.getLogger("cachehit_router.generation")


class ClientApi(Protocol):
    """A generation API vLLM serves as a chat completion it converts the body into (the
    Anthropic Messages API: router/server/messages.py): the request runs as that chat
    completion, and its answer is written in the API's own shape."""

    def chat_body(self, raw: bytes) -> bytes | None:
        """The chat completion body; None when only the engine's own route answers the
        request exactly (it is then `forward`ed)."""
        ...

    async def forward(self, request: web.Request, rec: RequestRecord, raw: bytes, tenant: Tenant) -> web.StreamResponse:
        """The client's body to one engine's own route, its answer relayed."""
        ...

    def framing(self) -> EventFraming:
        """The writer of one streamed answer."""
        ...

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion as this API's answer."""
        ...


class GenerationHandler:
    """Serves the generation routes; a request answered whole goes to the `forwarder`."""

    def __init__(self, state: Admission, forwarder: Forwarder):
        self.state = state
        self.forwarder = forwarder

    async def handle(
        self, request: web.Request, endpoint: str, api: ClientApi | None = None, label: str | None = None
    ) -> web.StreamResponse:
        """`api`: the request is `endpoint`'s (chat) as that API converts it; `label` names
        the route in the record."""
        state = self.state
        assert state.registry is not None
        assert state.dispatcher is not None
        t0 = state.last_arrival = time.monotonic()
        rec = RequestRecord(request_id="", endpoint=label or endpoint, model=None, stream=False)
        writer: SSEWriter | None = None
        shaper: ResponseShaper | None = None
        task = state.request_began()
        try:
            tenant, priority = state.identify(request)
            rec.tenant = tenant.name
            if state.draining:
                raise errors.RouterError(
                    503,
                    "The router is shutting down; send the request again "
                    "(it reaches another router or this one once restarted).",
                )
            check_length(request, state.config.server)
            # The body is read only once the request holds a slot: memory is bounded by
            # the limits (max_concurrent_requests bodies), not by how many clients arrive.
            # And within the bytes of bodies in flight (memory per request grows with its body).
            async with (
                state.limiter.slot(tenant, priority),
                state.body_budget.hold(body_reservation(request, state.config.server)),
            ):
                header_id = client_request_id(request)
                raw = await read_body(request, state.config.server)
                if api is not None:
                    converted = api.chat_body(raw)
                    if converted is None:
                        return await api.forward(request, rec, raw, tenant)
                    raw = converted
                served = state.registry.models()
                spec = parse_request(
                    endpoint, raw, default_model=served[0] if len(served) == 1 else None, header_request_id=header_id
                )
                del raw  # the parsed body is what the request keeps: not its bytes too
                check_priority(spec.body, tenant)  # the key's rule on vLLM's `priority` field
                answer_id = answer_request_id(header_id, spec.request_id)  # the X-Request-Id answered
                rec.request_id, rec.model, rec.stream = spec.request_id, spec.model, spec.stream
                # A configured LoRA adapter no engine holds is loaded with routing.lora_autoload.
                model = spec.model
                if (
                    model is not None
                    and served
                    and model not in served
                    and (state.adapters is None or not await state.adapters.ensure(model))
                ):
                    raise errors.model_not_found(model, served)
                if spec.whole:  # n > 1, batches, echo, prompt_logprobs: vLLM's own answer
                    return await self.forwarder.forward_generation(request, spec, rec, answer_id)
                if state.dispatcher.passes_through(spec):
                    raw = await state.dispatcher.serve_unary(spec, rec)
                    if api is not None:
                        raw = orjson.dumps(api.whole(orjson.loads(raw)))
                    return web.Response(body=raw, content_type="application/json", headers={"X-Request-Id": answer_id})
                shaper = ResponseShaper(spec)
                if spec.stream:
                    writer = SSEWriter(
                        request,
                        answer_id,
                        buffer_bytes=state.config.server.stream_buffer_bytes,
                        idle_s=state.config.timeouts.idle_s,
                        deadline=(state.loop or asyncio.get_running_loop()).time() + state.config.timeouts.total_s,
                        framing=api.framing() if api is not None else None,
                    )
                    try:
                        sse = api is None  # OpenAI's SSE: token chunks relayed on their bytes
                        await state.dispatcher.serve(
                            spec, shaper, writer.send, rec, writer.send_raw if sse else None, writer if sse else None
                        )
                        return await writer.finish(shaper.final_chunks())
                    except errors.RouterError as e:
                        if not writer.started:
                            raise
                        rec.status, rec.error = e.status, e.message
                        return await writer.fail(e)
                await state.dispatcher.serve(spec, shaper, _discard, rec, None if api is not None else _discard_raw)
                whole = shaper.accumulate_response()
                return json_response(whole if api is None else api.whole(whole), headers={"X-Request-Id": answer_id})
        except errors.RouterError as e:
            resp = state.refused(rec, e)
            if state.draining or not request.content.is_eof():
                # Refused before its body was read (401, 408, 413, 429), or shutting down:
                # no keep-alive (Connection: close); aiohttp discards what is left of the
                # body, for at most its lingering time (10 s), without keeping it.
                resp.force_close()
            return resp
        except asyncio.CancelledError:
            if not state.drain_expired:
                rec.status, rec.error = 499, "client disconnected"
                raise
            # Still running when the drain ran out: end it cleanly (the upstream legs are
            # already aborted), an error event then [DONE] if the stream started.
            err = errors.RouterError(
                503,
                "The router is shutting down: the request was cancelled after "
                f"server.drain_timeout_s = {state.config.server.drain_timeout_s:g} s.",
            )
            rec.status, rec.error = 503, err.message
            if writer is not None and writer.started:
                return await writer.fail(err)
            resp = error_response(err)
            resp.force_close()
            return resp
        except ConnectionResetError as e:
            # The client hung up while its answer was written, or stopped reading it
            # (ClientStalled): an expected event, told by the request's own log line (499),
            # without a traceback. Nobody can read a response any more.
            rec.status, rec.error = 499, str(e) if isinstance(e, ClientStalled) else "client disconnected"
            if writer is not None and writer.response is not None:
                return writer.response
            resp = error_response(errors.RouterError(400, "The client connection was reset."))
            resp.force_close()
            return resp
        except Exception as e:  # a router bug: answer 500 precisely, log the traceback
            log.exception("request %s failed", escape(rec.request_id))
            rec.status, rec.error = 500, repr(e)
            err = errors.internal_error(f"Internal router error: {type(e).__name__}")
            if writer is not None and writer.started:
                return await writer.fail(err)
            return error_response(err)
        finally:
            state.request_ended(task)
            rec.duration_s = time.monotonic() - t0
            if shaper is not None:  # also for answers cut short (disconnect, error)
                rec.completion_tokens = shaper.answer.token_count
            state.metrics.record(rec)


async def _discard(chunks: list[dict[str, Any]]) -> None:
    return None


async def _discard_raw(data: bytes, last: bool) -> None:
    return None  # a non-streaming client's answer is accumulated by the shaper
