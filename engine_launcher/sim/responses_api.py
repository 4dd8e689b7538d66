"""POST /v1/responses (the OpenAI Responses API) as vLLM 0.32 serves a text model's
request, within what the simulator models: text in, text out.

vLLM renders `instructions` (a system message) and `input` (a string: one user message;
or message items whose content is a string or `input_text`/`output_text` parts) through
the chat template and generates; so the simulator turns the body into the chat request
it stands for and runs it on its engine. The answer (vllm/entrypoints/openai/responses):
- whole: a `response` object: `id` (`resp_...`), `object`, `created_at`, `model`,
  `status` (`completed`, or `incomplete` with `incomplete_details.reason:
  "max_output_tokens"` when the budget ended it), `output` (one assistant `message` item
  with one `output_text` part), `usage` (`input_tokens`, `input_tokens_details.
  cached_tokens`, `output_tokens`, `output_tokens_details.reasoning_tokens`,
  `total_tokens`) and the request's settings echoed;
- streamed: `event: <type>` / `data: <json>` events, each with a `sequence_number`:
  `response.created`, `response.in_progress`, for the text `response.output_item.added`,
  `response.content_part.added`, `response.output_text.delta` per step,
  `response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
  then `response.completed` with the whole response. No `[DONE]`.
A `cache_threshold` finish (the engine's threshold) is `completed` with no output item, as
vLLM's is. Other input items (function calls, images, `previous_response_id`) are a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from .api_errors import ApiError
from .request import SimRequest

_MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses body stands for (raises ApiError 400)."""
    if body.get("previous_response_id") is not None:
        raise ApiError("The simulator stores no responses: `previous_response_id` is not supported.", 400)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError("`instructions` must be a string.", 400, param="instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            messages.append(_message(item))
    else:
        raise ApiError("`input` is required: a string or a list of items.", 400, param="input")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": body.get("stream") is True}
    for src, dst in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("vllm_xargs", "vllm_xargs"),
        ("kv_transfer_params", "kv_transfer_params"),
        ("cache_hit_threshold", "cache_hit_threshold"),
    ):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    return chat


def _message(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in _MESSAGE_ROLES:
        raise ApiError("The simulator reads only message items in `input`.", 400, param="input")
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise ApiError("The simulator reads only text parts in `input`.", 400, param="input")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if not isinstance(content, str):
        raise ApiError("A message item's `content` must be text.", 400, param="input")
    role = "system" if item["role"] == "developer" else item["role"]
    return {"role": role, "content": content}


class ResponseAnswer:
    """One response's constant fields and its events."""

    def __init__(self, body: dict[str, Any], model: str) -> None:
        self.body = body
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.created_at = int(time.time())
        self._seq = -1

    def response(self, req: SimRequest | None, text: str, status: str) -> dict[str, Any]:
        b = self.body
        output = []
        if req is not None and req.output_ids:
            output.append(self.item(text, "completed"))
        incomplete = status == "incomplete"
        return {
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.get("instructions"),
            "metadata": b.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "temperature": b.get("temperature", 1.0),
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools", []),
            "top_p": b.get("top_p", 1.0),
            "background": b.get("background", False),
            "max_output_tokens": b.get("max_output_tokens"),
            "previous_response_id": None,
            "status": status,
            "text": b.get("text"),
            "truncation": b.get("truncation", "disabled"),
            "usage": _usage(req) if req is not None else None,
            "user": b.get("user"),
        }

    def item(self, text: str, status: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        content = [part] if status == "completed" else []
        return {"id": self.item_id, "content": content, "role": "assistant", "status": status, "type": "message"}

    def event(self, kind: str, **fields: Any) -> bytes:
        self._seq += 1
        data = {"type": kind, "sequence_number": self._seq, **fields}
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def opening(self) -> bytes:
        started = self.response(None, "", "in_progress")
        return self.event("response.created", response=started) + self.event("response.in_progress", response=started)

    def text_opening(self) -> bytes:
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self.event("response.output_item.added", output_index=0, item=self.item("", "in_progress")) + self.event(
            "response.content_part.added", item_id=self.item_id, output_index=0, content_index=0, part=part
        )

    def delta(self, text: str) -> bytes:
        return self.event(
            "response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0, delta=text, logprobs=[]
        )

    def closing(self, req: SimRequest, text: str, status: str) -> bytes:
        out = b""
        if req.output_ids:
            part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
            ids = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
            out += self.event("response.output_text.done", **ids, text=text, logprobs=[])
            out += self.event("response.content_part.done", **ids, part=part)
            out += self.event("response.output_item.done", output_index=0, item=self.item(text, "completed"))
        return out + self.event("response.completed", response=self.response(req, text, status))


def status_of(req: SimRequest) -> str:
    return "incomplete" if req.finish_reason == "length" else "completed"


def _usage(req: SimRequest) -> dict[str, Any]:
    p, c = len(req.prompt_ids), len(req.output_ids)
    return {
        "input_tokens": p,
        "input_tokens_details": {"cached_tokens": max(req.num_cached_tokens, 0)},
        "output_tokens": c,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": p + c,
    }
