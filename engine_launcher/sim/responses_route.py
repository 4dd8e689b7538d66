"""The simulator's POST /v1/responses handler: the body turned into the chat request it
stands for (responses_api.py), run on the rank the request names, answered in the
Responses API's shape, whole or streamed."""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from . import responses_api as RA
from .api_errors import ApiError, json_error
from .config import SimEngineConfig
from .data_parallel import RankPicker
from .json_answers import error_response, json_response
from .protocol import parse_request
from .request import SimRequest

log = logging.getLogger("engine_launcher.sim")

GENERATION_ERROR = ApiError("Internal server error", 500, "InternalServerError")


async def serve_responses(request: web.Request, config: SimEngineConfig, ranks: RankPicker) -> web.StreamResponse:
    data = await request.read()
    try:
        body = orjson.loads(data)
        if not isinstance(body, dict):
            raise ApiError("Request body must be a JSON object.", 400)
        parsed = parse_request(RA.chat_body(body), config, True)
        engine = ranks.pick(request.headers)
    except orjson.JSONDecodeError:
        return error_response(json_error(data.decode("utf-8", errors="replace")))
    except ApiError as e:
        return error_response(e)
    if engine.dead:
        return error_response(ApiError("The engine is dead", 500, "InternalServerError"))
    answer = RA.ResponseAnswer(body, parsed.model)
    req = SimRequest(answer.id, parsed.prompt_ids, parsed.sampling, parsed.threshold, parsed.kv_transfer_params)
    engine.add_request(req)
    try:
        if not parsed.stream:
            while not req.finished:
                await req.event.wait()
                req.event.clear()
            if req.finish_reason == "error":
                return error_response(GENERATION_ERROR)
            return json_response(answer.response(req, req.output_text, RA.status_of(req)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await resp.write(answer.opening())
        text = ""
        while not req.finished:
            await req.event.wait()
            req.event.clear()
            _, delta, _ = req.drain()
            if delta:
                if not text:
                    await resp.write(answer.text_opening())
                text += delta
                await resp.write(answer.delta(delta))
        await resp.write(answer.closing(req, text, RA.status_of(req)))
        await resp.write_eof()
        return resp
    except ConnectionResetError:
        log.debug("client of %s disconnected", answer.id)
        return web.Response(status=499)
    finally:
        if not req.finished:
            engine.abort(answer.id)
