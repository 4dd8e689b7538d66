"""`POST /v1/responses`, the OpenAI Responses API: raced and fallen back, answered by vLLM.

Unlike `/v1/messages`, vLLM 0.32 does not answer `/v1/responses` from a chat completion:
it renders the prompt through the chat template itself, builds the response from its own
output parsers, and echoes the engine's effective sampling parameters (its defaults
included) in the response. The router could not rebuild that answer exactly, and the
answer carries no token ids to resume from. So the request is placed, not rewritten: a
race of one-token chat probes of the same prompt (router/admission/responses_request.py)
picks the engine that holds its KV cache, or where nobody accepts the fallback's decode
engine (`Dispatcher.place_whole`, as for the other requests only an engine can answer
whole), and the client's body goes there, the router's fields stripped and an explicit
threshold of 0 (top level and in `vllm_xargs`) so that an engine-wide default cannot
reject it; vLLM's own answer, streamed or not, is relayed. A failure before its first
byte is retried on another engine (router/server/relay.py); a stream broken after that
ends as the engine's stream did (no resume).

A body whose prompt the probe cannot reproduce goes to the least loaded engine serving
its model, as every forwarded route does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from router.admission.body import read_json_object
from router.admission.engine_body import XARGS, engine_json
from router.admission.responses_request import probe_chat_body
from router.admission.spec import ENDPOINT_CHAT, parse_request
from router.admission.tenants import Tenant
from router.engine.wire import THRESHOLD_KEY
from router.observability.record import RequestRecord
from router.observability.trace_context import client_request_id

if TYPE_CHECKING:
    from router.server.forward import Forwarder
    from router.server.services import Forwarding

RESPONSES_PATH = "/v1/responses"


def at_threshold_zero(body: dict[str, Any]) -> dict[str, Any]:
    """The body an engine gets: T = 0, read by the plugin at the top level and, on any
    vLLM, through `vllm_xargs` (which ResponsesRequest copies into the sampling params)."""
    xargs = body.get(XARGS)
    return {**body, THRESHOLD_KEY: 0.0, XARGS: {**(xargs if isinstance(xargs, dict) else {}), THRESHOLD_KEY: 0.0}}


class ResponsesHandler:
    def __init__(self, state: Forwarding, forwarder: Forwarder):
        self.state = state
        self.forwarder = forwarder

    async def handle(self, request: web.Request) -> web.StreamResponse:
        state, forwarder = self.state, self.forwarder

        async def serve(rec: RequestRecord, tenant: Tenant) -> web.StreamResponse:
            raw, body, model = await read_json_object(request, state.config.server)
            rec.model, rec.stream = model, body.get("stream") is True
            model = forwarder.check_model(model)
            sent = engine_json(raw, body, tenant)  # the router's fields stripped, priority checked
            probe = probe_chat_body(body)
            dispatcher = state.dispatcher
            if probe is None or dispatcher is None:
                return await forwarder.relay.forward(request, rec, model, sent, "application/json")
            served = state.registry.models() if state.registry is not None else []
            spec = parse_request(
                ENDPOINT_CHAT,
                orjson.dumps(probe),
                default_model=served[0] if len(served) == 1 else None,
                header_request_id=client_request_id(request),
            )

            async def choose(exclude: frozenset[str]) -> tuple[str, int] | None:
                return await dispatcher.place_whole(spec, rec, exclude)

            placed = orjson.dumps(at_threshold_zero(orjson.loads(sent)))
            return await forwarder.relay.forward(request, rec, model, placed, "application/json", choose=choose)

        return await forwarder.admitted(request, serve)
