"""The simulator's non-generation routes, in vLLM 0.32's JSON: POST /v1/embeddings,
POST /tokenize, POST /detokenize, POST /v1/audio/transcriptions and /translations.

Shapes (from vLLM's serve/tokenize and pooling/embed protocols, `model_dump()` of each):
- /tokenize: `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` null
  unless `return_token_strs`); a chat body (`messages`) is rendered first;
- /detokenize: `{"prompt"}`;
- /v1/embeddings: `{"id": "embd-<X-Request-Id or random>", "object": "list", "created",
  "model", "data": [{"index", "object": "embedding", "embedding"}], "usage":
  {"prompt_tokens", "total_tokens", "completion_tokens": 0, "prompt_tokens_details": null,
  "completion_tokens_details": null}}`; `encoding_format` `float` (default) or `base64`
  (the float32 values' bytes, little-endian: what the OpenAI SDK asks for by default).

- /v1/audio/transcriptions, /translations: `{"text", "usage": {"type": "duration",
  "seconds"}}` (TranscriptionResponse). The simulator decodes no audio: it reads the
  multipart upload as it arrives (`upload_bytes` counts the file bytes received so far,
  for tests that check an upload is streamed), and the text says how many bytes came;
  seconds assume 16 kHz 16-bit mono.

`faults.error_rate` applies here too: that fraction of requests is answered HTTP 500.

Embeddings are deterministic unit vectors of `EMBEDDING_DIM` floats derived from the
input's token ids: the same input always gets the same vector.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import BodyPartReader, web

from . import tokenizer as tok
from .api_errors import ApiError, json_error
from .config import SimEngineConfig

EMBEDDING_DIM = 32

Handler = Callable[[web.Request], Awaitable[web.Response]]


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def _body(request: web.Request, cfg: SimEngineConfig) -> dict[str, Any]:
    data = await request.read()
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise json_error(data.decode("utf-8", errors="replace")) from None
    if not isinstance(body, dict):
        raise ApiError("Request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != cfg.model and model not in cfg.lora_modules:
        raise ApiError(
            f"The model `{model}` does not exist. Valid aliases: {cfg.model}.", 404, "NotFoundError", "model"
        )
    return body


def _ids(value: Any, param: str) -> list[int]:
    if isinstance(value, str):
        return tok.encode(value)
    if isinstance(value, list) and all(type(t) is int and tok.is_valid_id(t) for t in value):
        return list(value)
    raise ApiError(f"`{param}` must be a string or a list of token ids.", param=param)


def embedding(ids: list[int]) -> list[float]:
    """A deterministic unit vector for a token sequence."""
    digest = hashlib.sha256(orjson.dumps(ids)).digest()
    raw = [(digest[i % 32] ^ (i * 131 % 256)) / 127.5 - 1.0 for i in range(EMBEDDING_DIM)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    # Rounded through float32, as vLLM's tensors are.
    return list(struct.unpack(f"<{EMBEDDING_DIM}f", struct.pack(f"<{EMBEDDING_DIM}f", *(x / norm for x in raw))))


class AuxRoutes:
    def __init__(self, cfg: SimEngineConfig):
        self.cfg = cfg
        self.upload_bytes = 0  # file bytes of audio uploads received so far
        self._rng = random.Random(cfg.seed)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self._guard(self.embeddings))
        app.router.add_post("/tokenize", self._guard(self.tokenize))
        app.router.add_post("/detokenize", self._guard(self.detokenize))
        app.router.add_post("/v1/audio/transcriptions", self._guard(self.audio))
        app.router.add_post("/v1/audio/translations", self._guard(self.audio))

    def _guard(self, handler: Handler) -> Handler:
        async def run(request: web.Request) -> web.Response:
            try:
                rate = self.cfg.faults.error_rate
                if rate and self._rng.random() < rate:
                    raise ApiError("Simulated engine failure (fault injection)", 500, "InternalServerError")
                return await handler(request)
            except ApiError as e:
                return _json(e.body(), e.status)

        return run

    async def embeddings(self, request: web.Request) -> web.Response:
        cfg = self.cfg
        body = await _body(request, cfg)
        inp = body.get("input")
        if isinstance(inp, str) or (isinstance(inp, list) and inp and type(inp[0]) is int):
            inputs = [_ids(inp, "input")]
        elif isinstance(inp, list) and inp:
            inputs = [_ids(x, "input") for x in inp]
        else:
            raise ApiError(
                "`input` must be a string, a list of strings, token ids or lists of token ids.", param="input"
            )
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise ApiError(f"encoding_format {fmt!r} is not supported by the simulator.", param="encoding_format")
        for ids in inputs:
            if len(ids) > cfg.max_model_len:
                raise ApiError(
                    f"This model's maximum context length is {cfg.max_model_len} tokens. "
                    f"However, you requested {len(ids)} tokens in the input for embedding "
                    "generation. Please reduce the length of the input.",
                    param="input",
                )
        data = []
        for i, ids in enumerate(inputs):
            vec = embedding(ids)
            value: Any = vec if fmt == "float" else base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
            data.append({"index": i, "object": "embedding", "embedding": value})
        n = sum(len(ids) for ids in inputs)
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return _json(
            {
                "id": f"embd-{base}",
                "object": "list",
                "created": int(time.time()),
                "model": cfg.model,
                "data": data,
                "usage": {
                    "prompt_tokens": n,
                    "total_tokens": n,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                    "completion_tokens_details": None,
                },
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _body(request, self.cfg)
        if "messages" in body:
            msgs = body["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise ApiError("`messages` must be a list of message objects.", param="messages")
            try:
                ids = tok.encode(tok.render_chat(msgs))
            except (KeyError, TypeError):
                raise ApiError("Each message needs a `role` and a `content`.", param="messages") from None
        elif isinstance(body.get("prompt"), str):
            ids = tok.encode(body["prompt"])
        else:
            raise ApiError("`prompt` (a string) or `messages` is required.", param="prompt")
        strs = [tok.token_text(t) for t in ids] if body.get("return_token_strs") else None
        return _json({"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _body(request, self.cfg)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise ApiError("`tokens` must be a list of token ids.", param="tokens")
        return _json({"prompt": tok.decode(_ids(tokens, "tokens"))})

    async def audio(self, request: web.Request) -> web.Response:
        try:
            reader = await request.multipart()
        except (AssertionError, ValueError, KeyError):
            raise ApiError("Expected a multipart/form-data body.") from None
        fields: dict[str, str] = {}
        size = 0
        seen_file = False
        async for part in reader:
            # A form upload's parts are plain body parts (nested multipart is not a form).
            assert isinstance(part, BodyPartReader)
            if part.filename is not None:
                seen_file = True
                while chunk := await part.read_chunk(64 * 1024):
                    size += len(chunk)
                    self.upload_bytes += len(chunk)
            elif part.name:
                fields[part.name] = (await part.read()).decode("utf-8", "replace")
        model = fields.get("model")
        if model and model != self.cfg.model:
            raise ApiError(
                f"The model `{model}` does not exist. Valid aliases: {self.cfg.model}.", 404, "NotFoundError", "model"
            )
        if not seen_file:
            raise ApiError("`file` is required.", param="file")
        return _json(
            {"text": f"{size} bytes of audio", "usage": {"type": "duration", "seconds": math.ceil(size / 32000)}}
        )
