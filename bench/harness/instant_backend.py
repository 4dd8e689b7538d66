"""An upstream that answers at once, in vLLM 0.32's shapes, for the overhead benchmark.

`python -m bench.harness.instant_backend --port A [--port B ...] [--chunks 32]`

POST /v1/completions (and /v1/chat/completions): non-streaming, one completion JSON with
usage; streaming (`"stream": true` in the body), `--chunks` text chunks (or the body's
`max_tokens`; the first with `prompt_token_ids`, each with `token_ids`, the last with
`finish_reason: "length"`), then the usage chunk when `include_usage`, then `data: [DONE]`,
as chunked transfer encoding. Written at once, unless the body's `user` field asks for
pacing as an engine paces its steps: `"pace_ms=1;burst=4"` writes 4 chunks per write, a
write every millisecond (`bench overhead --streams`).
GET /health, /metrics (the vLLM gauges a router scrapes), /v1/models.

It is a bare asyncio protocol on uvloop with pre-built answers, not an aiohttp app: the
benchmark needs a backend much faster than any router in front of it (it shares a core
with the load generator), so the measured ceiling is the router's, not the backend's.
It never looks at the prompt; a cache-hit threshold is ignored (every probe is accepted).
Every answer has an id of its own, as vLLM's (`cmpl-` or `chatcmpl-` and 32 hex digits): a
router that does per-answer work on the id (a regular expression compiled for it, a
cache it misses) pays for it here as it would in front of real engines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import uuid
from typing import ClassVar, cast

import orjson

MODEL = "sim-model"
# The pre-built answers' id digits, replaced by a fresh uuid4 hex per answer (same length,
# so the chunked framing stays right).
ID_DIGITS = b"5eed" * 8
_CMPL_ID = "cmpl-" + ID_DIGITS.decode()
_CHAT_ID = "chatcmpl-" + ID_DIGITS.decode()


def fresh(answer: bytes) -> bytes:
    """`answer` with an id of its own."""
    return answer.replace(ID_DIGITS, uuid.uuid4().hex.encode())


def _chunk_json(i: int, n: int, chat: bool) -> bytes:
    if chat:
        c = {
            "id": _CHAT_ID,
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": " tok"},
                    "logprobs": None,
                    "finish_reason": "length" if i == n - 1 else None,
                    "token_ids": [1000 + i],
                }
            ],
        }
        if i == 0:
            c["prompt_token_ids"] = [1, 2, 3, 4, 5, 6, 7, 8]
        return orjson.dumps(c)
    return orjson.dumps(
        {
            "id": _CMPL_ID,
            "object": "text_completion",
            "created": 1700000000,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "text": " tok",
                    "logprobs": None,
                    "finish_reason": "length" if i == n - 1 else None,
                    "stop_reason": None,
                    "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8] if i == 0 else None,
                    "token_ids": [1000 + i],
                }
            ],
        }
    )


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def build_answers(chunks: int) -> dict[str, bytes]:
    usage = {
        "prompt_tokens": 8,
        "total_tokens": 8 + chunks,
        "completion_tokens": chunks,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    out = {}
    for chat in (False, True):
        key = "chat" if chat else "cmpl"
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        body = b"".join(_frame(b"data: " + _chunk_json(i, chunks, chat) + b"\n\n") for i in range(chunks))
        usage_chunk = orjson.dumps(
            {
                "id": _CHAT_ID if chat else _CMPL_ID,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1700000000,
                "model": MODEL,
                "choices": [],
                "usage": usage,
            }
        )
        done = _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        out[f"{key}_stream"] = head + body + done
        out[f"{key}_stream_usage"] = head + body + _frame(b"data: " + usage_chunk + b"\n\n") + done
        if chat:
            js = {
                "id": _CHAT_ID,
                "object": "chat.completion",
                "created": 1700000000,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": " tok" * chunks},
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                        "token_ids": None,
                    }
                ],
                "usage": usage,
                "prompt_token_ids": None,
            }
        else:
            js = {
                "id": _CMPL_ID,
                "object": "text_completion",
                "created": 1700000000,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "text": " tok" * chunks,
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "token_ids": None,
                    }
                ],
                "usage": usage,
            }
        b = orjson.dumps(js)
        out[f"{key}_json"] = (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(b)
        ) + b
    metrics = (
        b"# TYPE vllm:num_requests_running gauge\n"
        b'vllm:num_requests_running{engine="0",model_name="sim-model"} 0.0\n'
        b"# TYPE vllm:num_requests_waiting gauge\n"
        b'vllm:num_requests_waiting{engine="0",model_name="sim-model"} 0.0\n'
        b"# TYPE vllm:kv_cache_usage_perc gauge\n"
        b'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.0\n'
    )
    models = orjson.dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": MODEL,
                    "object": "model",
                    "created": 1700000000,
                    "owned_by": "vllm",
                    "root": MODEL,
                    "parent": None,
                    "max_model_len": 8192,
                    "permission": [],
                }
            ],
        }
    )

    def plain(status: bytes, ctype: bytes, body: bytes) -> bytes:
        return b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (status, ctype, len(body), body)

    out["metrics"] = plain(b"200 OK", b"text/plain; version=0.0.4; charset=utf-8", metrics)
    out["metrics_body"] = metrics
    out["models"] = plain(b"200 OK", b"application/json", models)
    out["health"] = plain(b"200 OK", b"text/plain", b"")
    out["404"] = plain(
        b"404 Not Found",
        b"application/json",
        b'{"error":{"message":"Not Found","type":"NotFoundError","param":null,"code":404}}',
    )
    return out


def stream_parts(chunks: int, chat: bool, usage: bool) -> tuple[bytes, list[bytes], bytes]:
    """(head, one framed event per chunk, the rest: usage chunk, [DONE], last frame)."""
    key = "chat" if chat else "cmpl"
    whole = build_answers(chunks)[f"{key}_stream_usage" if usage else f"{key}_stream"]
    head_end = whole.index(b"\r\n\r\n") + 4
    frames = [_frame(b"data: " + _chunk_json(i, chunks, chat) + b"\n\n") for i in range(chunks)]
    body_end = head_end + sum(len(f) for f in frames)
    return whole[:head_end], frames, whole[body_end:]


def parse_pace(user: object) -> tuple[float, int] | None:
    """`"pace_ms=1;burst=4"` -> (0.001 s between writes, 4 chunks a write); else None."""
    if not isinstance(user, str) or "pace_ms=" not in user:
        return None
    fields = dict(kv.split("=", 1) for kv in user.split(";") if "=" in kv)
    return float(fields["pace_ms"]) / 1000, max(1, int(fields.get("burst", "1")))


class InstantProtocol(asyncio.Protocol):
    answers: ClassVar[dict[str, bytes]] = {}
    default_chunks = 32
    # (chunks, chat, usage) -> stream parts, for lengths other than --chunks
    parts: ClassVar[dict[tuple[int, bool, bool], tuple[bytes, list[bytes], bytes]]] = {}
    connections = 0  # accepted so far (in /metrics as instant_backend_connections_total)
    requests = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        InstantProtocol.connections += 1
        self.t = cast(asyncio.Transport, transport)  # a TCP server's transport
        self.buf = b""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket

            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            lower = head.lower()
            i = lower.find(b"content-length:")
            if i >= 0:
                j = lower.find(b"\r\n", i)
                length = int(head[i + 15 : j if j >= 0 else len(head)].strip())
            total = end + 4 + length
            if len(self.buf) < total:
                return
            body = self.buf[end + 4 : total]
            self.buf = self.buf[total:]
            self.respond(head, body)

    def respond(self, head: bytes, body: bytes) -> None:
        line = head[: head.find(b"\r\n")] if b"\r\n" in head else head
        parts = line.split(b" ")
        method, path = parts[0], parts[1] if len(parts) > 1 else b"/"
        a = self.answers
        if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
            InstantProtocol.requests += 1
            key = "chat" if path == b"/v1/chat/completions" else "cmpl"
            compact = body.replace(b" ", b"")
            if b'"stream":true' in compact:
                usage = b'"include_usage":true' in compact
                if b'"max_tokens"' in compact or b'"user"' in compact:
                    self.stream_sized(orjson.loads(body), key == "chat", usage)
                else:
                    self.t.write(fresh(a[f"{key}_stream_usage" if usage else f"{key}_stream"]))
            else:
                self.t.write(fresh(a[f"{key}_json"]))
        elif path == b"/health":
            self.t.write(a["health"])
        elif path == b"/metrics":
            extra = (
                b"# TYPE instant_backend_connections_total counter\ninstant_backend_connections_total %d\n"
                b"# TYPE instant_backend_requests_total counter\ninstant_backend_requests_total %d\n"
                % (InstantProtocol.connections, InstantProtocol.requests)
            )
            body = a["metrics_body"] + extra
            self.t.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
        elif path == b"/v1/models":
            self.t.write(a["models"])
        else:
            self.t.write(a["404"])

    def stream_sized(self, req: dict[str, object], chat: bool, usage: bool) -> None:
        """A stream of `max_tokens` chunks, paced when `user` asks for it."""
        n = req.get("max_tokens")
        n = n if isinstance(n, int) and n > 0 else self.default_chunks
        parts = self.parts.get((n, chat, usage))
        if parts is None:
            parts = self.parts[(n, chat, usage)] = stream_parts(n, chat, usage)
        head, frames, tail = parts
        pace = parse_pace(req.get("user"))
        rid = uuid.uuid4().hex.encode()
        if pace is None:
            self.t.write((head + b"".join(frames) + tail).replace(ID_DIGITS, rid))
            return
        gap, burst = pace
        self.t.write(head)
        loop = asyncio.get_running_loop()

        def write_from(i: int) -> None:
            if self.t.is_closing():
                return
            if i >= len(frames):
                self.t.write(tail.replace(ID_DIGITS, rid))
                return
            self.t.write(b"".join(frames[i : i + burst]).replace(ID_DIGITS, rid))
            loop.call_later(gap, write_from, i + burst)

        write_from(0)


async def serve(ports: list[int], chunks: int, host: str = "127.0.0.1") -> None:
    InstantProtocol.answers = build_answers(chunks)
    InstantProtocol.default_chunks = chunks
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(InstantProtocol, host, p, backlog=4096) for p in ports]
    for s in servers:
        print(f"instant backend listening on http://{host}:{s.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.harness.instant_backend")
    p.add_argument("--port", type=int, action="append", required=True)
    p.add_argument("--chunks", type=int, default=32)
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.run(serve(a.port, a.chunks))
    except ImportError:  # pragma: no cover
        asyncio.run(serve(a.port, a.chunks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
