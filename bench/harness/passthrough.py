"""The floor: a minimal aiohttp + uvloop pass-through proxy.

`python -m bench.harness.passthrough --port P --upstream URL`

POST /v1/completions and /v1/chat/completions are forwarded to one upstream over a pooled
`ClientSession` (TCP_NODELAY on both sides, as aiohttp does by default); a streamed answer
is relayed chunk by chunk, a JSON answer whole. No parsing, no validation, no metrics: what
any Python proxy must at least spend.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import aiohttp
from aiohttp import web


def build_app(upstream: str) -> web.Application:
    app = web.Application()
    state: dict[str, Any] = {}

    async def on_startup(_app: web.Application) -> None:
        state["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def on_cleanup(_app: web.Application) -> None:
        await state["s"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with state["s"].post(
            upstream + request.path, data=body, headers={"Content-Type": "application/json"}
        ) as up:
            ctype = up.headers.get("Content-Type", "application/json")
            if ctype.startswith("text/event-stream"):
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype})
                await resp.prepare(request)
                async for data in up.content.iter_any():
                    await resp.write(data)
                await resp.write_eof()
                return resp
            return web.Response(body=await up.read(), status=up.status, headers={"Content-Type": ctype})

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=200)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.harness.passthrough")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    a = p.parse_args(argv)
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        loop = asyncio.new_event_loop()
    web.run_app(
        build_app(a.upstream.rstrip("/")), host="127.0.0.1", port=a.port, print=None, access_log=None, loop=loop
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
