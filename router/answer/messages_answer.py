"""A chat completion answer rewritten as vLLM 0.32 answers `/v1/messages`.

The router serves an Anthropic Messages request as the chat completion vLLM makes of it
(router/admission/messages_request.py); this module turns the chat answer the
`ResponseShaper` produced (the client-facing chunks, or the whole body) into what vLLM's
`AnthropicServingMessages` sends for the same chat answer: `message_start`, content blocks
(`text`, `thinking`, `tool_use`) opened, filled and closed, `message_delta` with the stop
reason and usage, `message_stop`; or the whole message. Each step below is the one vLLM's
converter takes, written over dicts (its pydantic models serialised with
`exclude_unset`: only the fields it sets appear).

Finish reasons map as vLLM maps them: `length` -> `max_tokens`, `stop` -> `end_turn` (or
`stop_sequence` with the matched string, or `tool_use`), `tool_calls` -> `tool_use`;
anything else, `cache_threshold` included, has no Anthropic name: `stop_reason: null`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson

from router.errors import RouterError

EVENT_ERROR = "error"


def anthropic_error(err: RouterError) -> dict[str, Any]:
    """vLLM's Anthropic error body: the OpenAI error's type and message in Anthropic's envelope."""
    return {"type": "error", "error": {"type": err.type, "message": err.message}}


def error_event(err: RouterError) -> bytes:
    return _event(EVENT_ERROR, anthropic_error(err))


def usage_of(usage: Any) -> dict[str, Any]:
    """vLLM's `_build_anthropic_usage`: Anthropic counts input tokens net of cache reads."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    out: dict[str, Any] = {"input_tokens": 0, "output_tokens": usage.get("completion_tokens") or 0}
    input_tokens = usage.get("prompt_tokens") or 0
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        cache_read = details.get("cached_tokens")
        if cache_read is not None:
            input_tokens -= cache_read
            out["cache_read_input_tokens"] = cache_read
        created = details.get("created_cache_tokens")
        if created is not None:
            input_tokens -= created
            out["cache_creation_input_tokens"] = created
    out["input_tokens"] = max(0, input_tokens)
    return out


def stop_reason_of(
    finish_reason: str | None, stop_reason: Any, *, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """vLLM's `_to_anthropic_stop_reason`: (stop_reason, stop_sequence)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def whole_message(chat: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `messages_full_converter` of a whole chat completion (`exclude_none`)."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    tool_calls = message.get("tool_calls") or []
    stop, sequence = stop_reason_of(
        choice.get("finish_reason"),
        choice.get("stop_reason"),
        tool_used=bool(tool_calls),
        tool_complete=bool(tool_calls),
    )
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in tool_calls:
        function = call["function"]
        content.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": json.loads(function["arguments"])}
        )
    if not content:  # Anthropic's shape of an empty completion: one empty text block
        content.append({"type": "text", "text": ""})
    out: dict[str, Any] = {"id": chat["id"], "type": "message", "role": "assistant", "content": content}
    out["model"] = chat["model"]
    if stop is not None:
        out["stop_reason"] = stop
    if sequence is not None:
        out["stop_sequence"] = sequence
    out["usage"] = usage_of(chat.get("usage"))
    return out


class MessagesStream:
    """vLLM's `message_stream_converter` over the client-facing chat chunks of one answer:
    `encode` per batch of chunks, `trailer` at the stream's end (where vLLM reads `[DONE]`),
    `error` for a failure after the stream started (the writer's framing,
    router/server/respond.py)."""

    def __init__(self) -> None:
        self._first = True
        self._finish_reason: str | None = None
        self._stop_sequence: Any = None
        self._tool_used = False
        self._last_tool_args: list[str] = []
        self._tool_ids: dict[int, str] = {}
        # The open content block.
        self._index = 0  # the next block's index
        self._block_type: str | None = None
        self._block_index: int | None = None
        self._signature: str | None = None
        self._signature_sent = False
        self._tool_use_id: str | None = None
        self._pending: list[str] = []  # text seen inside a tool_use block, sent after it

    def encode(self, chunks: list[dict[str, Any]]) -> bytes:
        out: list[bytes] = []
        for chunk in chunks:
            self._chunk(chunk, out)
        return b"".join(out)

    def trailer(self) -> bytes:
        out = self._stop_and_flush()
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def error(self, err: RouterError) -> bytes:
        return error_event(err)

    # --- one chunk ---------------------------------------------------------------------
    def _chunk(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        if self._first:
            self._first = False
            message = {
                "id": chunk["id"],
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": chunk["model"],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage_of(chunk.get("usage")),
            }
            out.append(_event("message_start", {"type": "message_start", "message": message}))
            return
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk: the message's end
            out += self._stop_and_flush()
            stop, sequence = stop_reason_of(
                self._finish_reason or "stop",
                self._stop_sequence,
                tool_used=self._tool_used,
                tool_complete=self._tool_used and _is_json("".join(self._last_tool_args)),
            )
            data = {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": sequence},
                "usage": usage_of(chunk.get("usage")),
            }
            out.append(_event("message_delta", data))
            return
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
            self._stop_sequence = choice.get("stop_reason")
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning")
        if reasoning:
            if self._block_type != "thinking":
                out += self._stop_and_flush()
                out.append(self._start({"type": "thinking", "thinking": ""}))
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        text = delta.get("content")
        if text:
            if self._block_type == "tool_use":
                self._pending.append(text)
            else:
                if self._block_type != "text":
                    out += self._stop_and_flush()
                    out.append(self._start({"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            self._tool_call(call, out)

    def _tool_call(self, call: dict[str, Any], out: list[bytes]) -> None:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if call.get("id") is not None:
            self._tool_ids[call.get("index", 0)] = call["id"]
            name = function.get("name")
            if self._tool_use_id != call["id"] and name is not None:
                out += self._stop_and_flush()
                self._tool_used = True
                self._last_tool_args = []
                out.append(self._start({"type": "tool_use", "id": call["id"], "name": name, "input": {}}))
            if arguments and self._tool_use_id == call["id"]:
                self._last_tool_args.append(arguments)
                out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            return
        tool_use_id = self._tool_ids.get(call.get("index", 0))
        if tool_use_id is not None and arguments and self._tool_use_id == tool_use_id:
            self._last_tool_args.append(arguments)
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))

    # --- content blocks ------------------------------------------------------------------
    def _start(self, block: dict[str, Any]) -> bytes:
        data = {"type": "content_block_start", "content_block": block, "index": self._index}
        self._block_type = block["type"]
        self._block_index = self._index
        self._tool_use_id = block.get("id") if block["type"] == "tool_use" else None
        self._signature = uuid.uuid4().hex if block["type"] == "thinking" else None
        self._signature_sent = block["type"] != "thinking"
        return _event("content_block_start", data)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        index = self._block_index if self._block_index is not None else self._index
        return _event("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": index})

    def _stop_block(self) -> list[bytes]:
        if self._block_type is None:
            return []
        out: list[bytes] = []
        if self._block_type == "thinking" and self._signature is not None and not self._signature_sent:
            out.append(self._delta({"type": "signature_delta", "signature": self._signature}))
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self._block_index}))
        self._block_type = self._block_index = self._signature = self._tool_use_id = None
        self._signature_sent = False
        self._pending.clear()
        self._index += 1
        return out

    def _stop_and_flush(self) -> list[bytes]:
        buffered = "".join(self._pending)
        self._pending.clear()
        out = self._stop_block()
        if not buffered:
            return out
        out.append(self._start({"type": "text", "text": ""}))
        out.append(self._delta({"type": "text_delta", "text": buffered}))
        out += self._stop_block()
        return out
