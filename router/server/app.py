"""The aiohttp application: routes, middlewares and lifecycle.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health
(alive), GET /ready (a decode backend can take requests), GET /metrics, vLLM's other routes
(`router/server/forward.py`) and the admin routes (`router/server/admin.py`; backends that come and go:
`router/fleet/membership.py`, SIGHUP reload: `router/server/reload.py`). Lifecycle: start the engines the
configuration declares (the launcher plugin: `router/fleet/engine_starter.py`), build the backend registry, run one
health round before serving, scrape in the background, and on shutdown stop listening, let
in-flight requests drain for up to server.drain_timeout_s, cancel the rest cleanly (503 or
an error event then [DONE]), then stop the engines (`RouterState.drain`, `stop`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Handler

from router import errors
from router.admission.body import expect_handler
from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS
from router.config.schema import Config
from router.observability import tracing
from router.server.admin import AdminApi
from router.server.lora_routes import LoraApi
from router.server.messages import MESSAGES_PATH
from router.server.respond import error_response
from router.server.responses import RESPONSES_PATH

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

from router.server.state import RouterState

log = logging.getLogger("cachehit_router.app")


ROUTER_KEY: web.AppKey[RouterState] = web.AppKey("router", RouterState)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every answer, even aiohttp's own 404/405/413, in the OpenAI error shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status == 404:
            return error_response(errors.route_not_found())
        if e.status == 405:
            return error_response(errors.method_not_allowed())
        if e.status == 413:
            return error_response(errors.payload_too_large(request.app[ROUTER_KEY].config.server.max_body_bytes))
        if e.status >= 400:
            return error_response(errors.RouterError(e.status, e.reason))
        raise


def build_app(
    config: Config, *, start_engines: bool = True, span_exporter: SpanExporter | None = None
) -> web.Application:
    state = RouterState(config, start_engines=start_engines, span_exporter=span_exporter)
    app = web.Application(
        middlewares=[tracing.middleware(lambda: state.tracing), error_middleware],
        client_max_size=config.server.max_body_bytes,
    )
    app[ROUTER_KEY] = state

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await state.start()
        yield
        await state.stop()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(state.drain)
    # partial, not a lambda: aiohttp sees a coroutine function and calls it directly (a plain
    # function gets wrapped in an extra coroutine that re-checks its result on every request).
    app.router.add_post(
        "/v1/completions",
        functools.partial(state.generation.handle, endpoint=ENDPOINT_COMPLETIONS),
        expect_handler=expect_handler,
    )
    app.router.add_post(
        "/v1/chat/completions",
        functools.partial(state.generation.handle, endpoint=ENDPOINT_CHAT),
        expect_handler=expect_handler,
    )
    app.router.add_post(MESSAGES_PATH, state.messages.handle, expect_handler=expect_handler)
    app.router.add_post(RESPONSES_PATH, state.responses.handle, expect_handler=expect_handler)
    app.router.add_get("/v1/models", state.handle_models)
    state.forwarder.add_routes(app.router)  # vLLM's other routes (router/server/forward.py)
    app.router.add_get("/health", state.handle_health)
    app.router.add_get("/ready", state.handle_ready)
    app.router.add_get("/metrics", state.handle_metrics)
    AdminApi(state).add_routes(app.router)  # router/server/admin.py
    LoraApi(state).add_routes(app.router)  # router/server/lora_routes.py (admin key)
    return app
