"""`POST /v1/messages`, the Anthropic Messages API, raced, fallen back and resumed like a
chat completion.

vLLM 0.32 answers `/v1/messages` by converting the body into a chat completion request,
running it, and rewriting the chat answer (`vllm/entrypoints/anthropic/serving.py`). The
router does exactly that around its own chat pipeline (router/server/generation.py): the
body becomes the same chat completion (router/admission/messages_request.py), which races
on the engines' `/v1/chat/completions` at the cache-hit threshold, falls back to
prefill/decode and resumes with token ids like any chat request, and the answer is
written as vLLM's converter writes it (router/answer/messages_answer.py). So the client
gets what the engine's own `/v1/messages` would have sent, and every engine leg is one
the router already knows how to read.

A body the conversion does not cover exactly goes whole to one engine's own
`/v1/messages` (the least loaded serving its model; no race, no resume), its own fields
stripped as on every route (router/admission/engine_body.py).

Errors have vLLM's Anthropic shape (`{"type": "error", "error": {"type", "message"}}`)
with the status vLLM would give; in a started stream, an `event: error`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from router import errors
from router.admission.engine_body import engine_json
from router.admission.messages_request import NotConvertible, chat_body_of, check_messages_body
from router.admission.spec import ENDPOINT_CHAT
from router.admission.tenants import Tenant
from router.answer.messages_answer import MessagesStream, anthropic_error, whole_message
from router.observability.record import RequestRecord

if TYPE_CHECKING:
    from router.server.forward import Forwarder
    from router.server.generation import GenerationHandler
    from router.server.respond import EventFraming

log = logging.getLogger("cachehit_router.messages")

MESSAGES_PATH = "/v1/messages"
LABEL = "messages"


class MessagesApi:
    """The Messages API as a `ClientApi` of the generation handler."""

    def __init__(self, forwarder: Forwarder):
        self.forwarder = forwarder

    def chat_body(self, raw: bytes) -> bytes | None:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise errors.bad_request(f"Request body is not valid JSON: {e}") from None
        body = check_messages_body(body)
        try:
            return orjson.dumps(chat_body_of(body))
        except NotConvertible as e:
            log.debug("messages body answered by the engine's own route: %s", e)
            return None

    async def forward(self, request: web.Request, rec: RequestRecord, raw: bytes, tenant: Tenant) -> web.StreamResponse:
        body = orjson.loads(raw)  # checked by chat_body
        model = body.get("model")
        rec.model, rec.stream = model, body.get("stream") is True
        relay = self.forwarder.relay
        return await relay.forward(request, rec, model, engine_json(raw, body, tenant), "application/json")

    def framing(self) -> EventFraming:
        return MessagesStream()

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        return whole_message(chat)


class MessagesHandler:
    def __init__(self, generation: GenerationHandler, forwarder: Forwarder):
        self.generation = generation
        self.api = MessagesApi(forwarder)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        resp = await self.generation.handle(request, ENDPOINT_CHAT, api=self.api, label=LABEL)
        return anthropic_shaped(resp)


def anthropic_shaped(resp: web.StreamResponse) -> web.StreamResponse:
    """An error the router answered in OpenAI's shape, in Anthropic's (an engine's own
    `/v1/messages` error already is)."""
    if not isinstance(resp, web.Response) or resp.status < 400 or not isinstance(resp.body, bytes):
        return resp
    try:
        body = orjson.loads(resp.body)
    except orjson.JSONDecodeError:
        return resp
    if not isinstance(body, dict) or body.get("type") == "error" or not isinstance(body.get("error"), dict):
        return resp
    err = body["error"]
    shaped = anthropic_error(errors.RouterError(resp.status, str(err.get("message", "")), type=err.get("type")))
    resp.body = orjson.dumps(shaped)
    return resp
