"""Sending one client request to an engine that serves its model, and relaying the answer.

The engine is the least loaded available one that serves the body's `model` (or the one a
`choose` callback names: generations answered whole go where the strategy places them).
Failures before the answer's first byte (no connection, an HTTP 5xx, silence until
`timeouts.first_token_s`) are retried on another engine, up to `routing.max_retries`; an
upload's body can be sent once, so it is retried only if the engine refused the connection
before reading any of it. The answer goes back as it comes: status, headers that matter,
body, SSE included. `find=True` asks every engine in turn until one does not answer 404
(a response stored in one engine's memory).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from router import errors
from router.admission.body import BodyReader
from router.config.data_parallel import rank_headers
from router.engine.errors import MAX_ERROR_BODY
from router.names import Route
from router.observability import tracing
from router.observability.record import RequestRecord
from router.routing.snapshot import ClusterSnapshot
from router.server.respond import close_if_unframed

if TYPE_CHECKING:
    from router.server.services import Engines

log = logging.getLogger("cachehit_router.forward")

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


class EngineRelay:
    """Forwards requests to the engines."""

    def __init__(self, state: Engines):
        self.state = state

    async def forward(
        self,
        request: web.Request,
        rec: RequestRecord,
        model: str | None,
        body: bytes | None,
        content_type: str | None,
        *,
        find: bool = False,
        rest: BodyReader | None = None,
        limit: int = 0,
        choose: Callable[[frozenset[str]], Awaitable[tuple[str, int] | None]] | None = None,
        request_id_header: bool = True,
        answer_id: str | None = None,
    ) -> web.StreamResponse:
        """`choose` (generations): the engine and the prompt tokens it will prefill, for the
        cost model's load (a `LegTicket`), instead of the least loaded engine."""
        state = self.state
        registry, client, timeouts = state.registry, state.client, state.config.timeouts
        assert registry is not None
        assert client is not None
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
            while True:
                data = await rest.readany()  # within the body's deadline (a 408 past it)
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
            if name is None or (len(exclude) >= attempts and not find):
                break
            exclude.add(name)
            chosen = registry.accepting(name)
            if chosen is None:  # removed or drained while it was being chosen
                continue
            cfg = chosen.config
            leg, trace = tracing.start_leg(tracing.LEG_FORWARD, name, request.path)
            headers = {**trace, **({"Content-Type": content_type} if content_type else {}), **rank_headers(cfg)}
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
                    if rest is not None and rest.error is not None:  # the client's body came too slowly
                        raise rest.error from None
                    problem = "no answer in time" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
                    registry.record_failure(name, f"forward: {problem}")
                    rec.upstream_errors.append((name, "forward"))  # counted when the request is recorded
                    last_problem = f"engine {name!r}: {problem}"
                    if resp is not None:
                        resp.close()
                    if rest_started[0]:  # part of the upload is gone: it cannot be sent again
                        raise errors.upstream_failed(name, problem) from None
                    rec.retries += 1
                    continue
                if resp.status in _RETRY_STATUSES and (find or len(exclude) < attempts) and not rest_started[0]:
                    err_body = await resp.content.read(MAX_ERROR_BODY)
                    last = (resp.status, err_body, _answer_headers(resp))
                    resp.release()
                    registry.record_failure(name, f"forward: HTTP {resp.status}")
                    rec.upstream_errors.append((name, "status"))
                    rec.retries += 1
                    continue
                if find and resp.status == 404:
                    last = (404, await resp.content.read(MAX_ERROR_BODY), _answer_headers(resp))
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
        close_if_unframed(request, out)
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
