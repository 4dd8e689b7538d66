"""Scripted engines at the router's upstream interface (router/engine/client.py), no network.

`FakeUpstream` stands in for `UpstreamClient` (`open_stream`, `post_json`, `post_raw`);
each streamed leg is a `FakeStream` with the `UpstreamStream` interface (`next_chunk`,
`next_chunks`, `abort`, `finish`, the `on_close` callback) that plays a script: chunks,
pauses, an `UpstreamError` to raise, or `HANG` (silent until cancelled). The end of the
script is the engine's [DONE].
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import orjson

from router.engine.errors import UpstreamError

if TYPE_CHECKING:
    from router.engine.stream import UpstreamStream

HANG = object()  # the engine says nothing more until the leg is cancelled


@dataclass(frozen=True)
class Pause:
    seconds: float


class FakeStream:
    def __init__(self, backend: str, script: list[Any], on_close: Callable[[], None] | None) -> None:
        self.backend = backend
        self.loop = asyncio.get_running_loop()
        self._script = list(script)
        self._on_close = on_close
        self.aborted = False
        self.finished = False

    async def next_chunk(self) -> dict[str, Any] | None:
        while True:
            if self.aborted or not self._script:
                return None
            item = self._script.pop(0)
            if isinstance(item, Pause):
                await asyncio.sleep(item.seconds)
            elif item is HANG:
                await asyncio.Event().wait()
            elif isinstance(item, BaseException):
                raise item
            else:
                chunk: dict[str, Any] = item
                return chunk

    async def next_chunks(self) -> list[dict[str, Any]]:
        chunk = await self.next_chunk()
        return [] if chunk is None else [chunk]

    def abort(self) -> None:
        self.aborted = True
        self._closed()

    def finish(self) -> None:
        self.finished = True
        self._closed()

    @property
    def closed(self) -> bool:
        return self.aborted or self.finished

    def _closed(self) -> None:
        cb, self._on_close = self._on_close, None
        if cb is not None:
            cb()


@dataclass
class Call:
    backend: str
    path: str
    body: dict[str, Any]


@dataclass
class FakeUpstream:
    """Per backend, the scripts of its next legs in order: a list (a streamed leg), a dict
    (a non-streaming answer) or an UpstreamError (the call fails at once)."""

    scripts: dict[str, list[Any]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)

    def _next(self, backend: str, path: str, body: dict[str, Any]) -> Any:
        self.calls.append(Call(backend, path, body))
        script = self.scripts[backend].pop(0)
        if isinstance(script, UpstreamError):
            raise script
        return script

    async def open_stream(
        self,
        backend: str,
        base_url: str,
        path: str,
        body: dict[str, Any],
        *,
        api_key: str = "",
        total_deadline: float | None = None,
        on_close: Callable[[], None] | None = None,
        encoded: bytes | None = None,
    ) -> FakeStream:
        # `encoded` (the body serialised once for a race's legs) must be that body.
        assert encoded is None or orjson.loads(encoded) == body
        stream = FakeStream(backend, self._next(backend, path, body), on_close)
        self.streams.append(stream)
        return stream

    async def post_json(
        self,
        backend: str,
        base_url: str,
        path: str,
        body: dict[str, Any],
        *,
        api_key: str = "",
        total_deadline: float | None = None,
    ) -> dict[str, Any]:
        answer: dict[str, Any] = self._next(backend, path, body)
        return answer

    def opener(
        self, path: str = "/v1/completions", body: dict[str, Any] | None = None
    ) -> Callable[[str], Awaitable[UpstreamStream]]:
        """An `open_probe` for router.dispatch.race.run_race."""

        async def open_probe(name: str) -> UpstreamStream:
            # A FakeStream has the UpstreamStream interface (see the module docstring).
            return cast("UpstreamStream", await self.open_stream(name, "", path, body or {}))

        return open_probe

    def legs_to(self, backend: str) -> list[Call]:
        return [c for c in self.calls if c.backend == backend]


# --- vLLM 0.32 completion stream chunks (return_token_ids, include_usage) ---------------------


def token(text: str, ids: list[int], finish: str | None = None, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    return {
        "id": "cmpl-engine",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_token_ids": prompt_ids,
                "token_ids": ids,
            }
        ],
    }


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "cmpl-engine", "object": "text_completion", "created": 1, "model": "m", "choices": [], "usage": u}


def rejection(prompt: int, cached: int) -> list[Any]:
    """A threshold rejection: `cache_threshold` with nothing generated, then the usage."""
    return [token("", [], finish="cache_threshold"), usage(prompt, 0, cached)]


def answer(prompt_ids: list[int], words: list[tuple[str, int]], cached: int = 0) -> list[Any]:
    """A whole answer: one chunk per (text, token id), the last one finishing with stop."""
    out = []
    for k, (text, tid) in enumerate(words):
        out.append(
            token(
                text, [tid], finish="stop" if k == len(words) - 1 else None, prompt_ids=prompt_ids if k == 0 else None
            )
        )
    return [*out, usage(len(prompt_ids), len(words), cached)]
