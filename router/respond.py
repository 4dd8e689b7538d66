"""The client-facing writer for streaming answers.

Headers go out with the first chunk, not before: until then a failure can still be an
HTTP error status with a JSON body. After that, an error travels as vLLM sends it, an
error event followed by `data: [DONE]`.
"""
from __future__ import annotations

from aiohttp import web

from .errors import RouterError, sse_error_event
from .sse import DONE_EVENT, format_event


class SSEWriter:
    def __init__(self, request: web.Request, request_id: str):
        self.request = request
        self.request_id = request_id
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    async def _start(self) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Request-Id": self.request_id,
        })
        await resp.prepare(self.request)
        self.response = resp
        return resp

    async def send(self, chunks: list[dict]) -> None:
        if not chunks:
            return
        resp = self.response or await self._start()
        if len(chunks) == 1:
            await resp.write(format_event(chunks[0]))
        else:
            await resp.write(b"".join(format_event(c) for c in chunks))

    async def finish(self) -> web.StreamResponse:
        resp = self.response or await self._start()
        await resp.write(DONE_EVENT)
        await resp.write_eof()
        return resp

    async def fail(self, err: RouterError) -> web.StreamResponse:
        """Only after the stream started: an error event, then [DONE]."""
        assert self.response is not None
        await self.response.write(sse_error_event(err) + DONE_EVENT)
        await self.response.write_eof()
        return self.response
