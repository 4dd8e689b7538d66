"""An Anthropic Messages API body (`POST /v1/messages`) as the chat completion request vLLM
makes of it.

vLLM 0.32 serves `/v1/messages` by converting the body into a `ChatCompletionRequest`,
running its own chat completion, and rewriting the chat answer into Anthropic's shape
(`vllm/entrypoints/anthropic/serving.py`). The router does the same conversion, so the
request races, falls back and resumes as a chat completion does (token ids and all), and
router/answer/messages_answer.py rewrites the answer as vLLM would. The conversion below
follows vLLM's field for field; what it does not cover exactly returns None, and such a
request goes whole to one engine's own `/v1/messages` (router/server/messages.py):
- a `system` message inside `messages` (vLLM merges it into the first one or not,
  depending on the model's chat template);
- `thinking: {"type": "disabled"}` (vLLM probes the template for the effort it uses);
- `tool_reference`, `tool_addition`, `tool_removal` and document blocks, image sources
  other than base64 and URL;
- a body vLLM itself would reject (a field of the wrong type): its own error comes back.

The client's `kv_transfer_params`, `ec_transfer_params` and `cache_hit_threshold` (top
level and in `vllm_xargs`) are dropped as on every route (router/admission/engine_body.py).
`stream: true` asks for usage on every chunk, as vLLM's conversion does.
"""

from __future__ import annotations

import json
import time
from typing import Any

from router.admission.engine_body import strip_router_fields
from router.errors import RouterError

# Claude Code's attribution header carries a per-request hash; vLLM drops it.
_BILLING_HEADER = "x-anthropic-billing-header"

# Top-level fields vLLM's AnthropicMessagesRequest reads, with the check each must pass
# here (a failure is left to the engine's own validation: the body goes whole).
_KNOWN = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "metadata",
        "output_config",
        "thinking",
        "stop_sequences",
        "stream",
        "system",
        "temperature",
        "tool_choice",
        "tools",
        "top_k",
        "top_p",
        "cache_salt",
        "watermarking",
        "vllm_xargs",
        "chat_template_kwargs",
        "kv_transfer_params",
        "ec_transfer_params",
        "cache_hit_threshold",
        "mm_payload",
        "return_mm_kwargs",
    }
)


class NotConvertible(Exception):
    """The router cannot reproduce vLLM's conversion of this body exactly."""


def check_messages_body(body: Any) -> dict[str, Any]:
    """The fields the router reads itself; a 400 for one it cannot read."""
    if not isinstance(body, dict):
        raise RouterError(400, "Request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str):
        raise RouterError(400, "`model` is required and must be a string.", param="model")
    if not isinstance(body.get("messages"), list):
        raise RouterError(400, "`messages` is required and must be a list.", param="messages")
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int:
        raise RouterError(400, "`max_tokens` is required and must be an integer.", param="max_tokens")
    return body


def chat_body_of(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion body vLLM builds from a checked Messages body; raises
    NotConvertible where only the engine's own route can answer exactly."""
    body = dict(body)
    strip_router_fields(body)
    unknown = set(body) - _KNOWN
    if unknown:  # a field this conversion does not know (a newer vLLM's): its own route
        raise NotConvertible(f"unknown fields {sorted(unknown)}")
    messages: list[dict[str, Any]] = []
    _system(body.get("system"), messages)
    for msg in body["messages"]:
        _message(msg, messages)
    chat: dict[str, Any] = {
        "model": body["model"],
        "messages": messages,
        "max_tokens": body["max_tokens"],
        "max_completion_tokens": body["max_tokens"],
    }
    for src, dst in (
        ("stop_sequences", "stop"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("watermarking", "watermarking"),
        ("cache_salt", "cache_salt"),
        ("vllm_xargs", "vllm_xargs"),
        ("chat_template_kwargs", "chat_template_kwargs"),
    ):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    _output_config(body.get("output_config"), chat)
    _thinking(body.get("thinking"), chat)
    _tools(body.get("tools"), body.get("tool_choice"), chat)
    return chat


def _system(system: Any, out: list[dict[str, Any]]) -> None:
    if not system:
        return
    if isinstance(system, str):
        out.append({"role": "system", "content": system})
        return
    if not isinstance(system, list):
        raise NotConvertible("system")
    parts = []
    for block in system:
        if not isinstance(block, dict):
            raise NotConvertible("system block")
        text = block.get("text")
        if block.get("type") == "text" and text:
            if not isinstance(text, str):
                raise NotConvertible("system text")
            if not text.startswith(_BILLING_HEADER):
                parts.append(text)
    if parts:
        out.append({"role": "system", "content": "".join(parts)})


def _message(msg: Any, out: list[dict[str, Any]]) -> None:
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise NotConvertible("a message that is not a user or assistant turn")
    role = msg["role"]
    content = msg.get("content")
    entry: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        entry["content"] = content
    elif isinstance(content, list):
        parts: list[dict[str, Any]] = []
        tool_calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content:
            _block(block, role, parts, tool_calls, reasoning, out)
        if reasoning:
            entry["reasoning"] = "".join(reasoning)
        if tool_calls:
            entry["tool_calls"] = tool_calls
        if len(parts) == 1 and parts[0]["type"] == "text":
            entry["content"] = parts[0]["text"]
        elif parts:
            entry["content"] = parts
    else:
        raise NotConvertible("message content")
    if not (role == "user" and "content" not in entry):
        out.append(entry)


def _block(
    block: Any,
    role: str,
    parts: list[dict[str, Any]],
    tool_calls: list[dict[str, Any]],
    reasoning: list[str],
    out: list[dict[str, Any]],
) -> None:
    if not isinstance(block, dict):
        raise NotConvertible("content block")
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if text:
            if not isinstance(text, str):
                raise NotConvertible("text")
            parts.append({"type": "text", "text": text})
    elif kind == "image":
        if block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
    elif kind == "thinking":
        if block.get("thinking") is not None:
            reasoning.append(block["thinking"])
    elif kind == "redacted_thinking":
        pass  # opaque to any model; vLLM accepts and skips it
    elif kind == "tool_use":
        tool_calls.append(
            {
                # vLLM names an id-less call after the clock; only a call with an id converts exactly.
                "id": block.get("id") or f"call_{int(time.time())}",
                "type": "function",
                "function": {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})},
            }
        )
    elif kind == "tool_result":
        _tool_result(block, role, parts, out)
    else:
        raise NotConvertible(f"{kind!r} block")


def _image_url(source: Any) -> str:
    if not isinstance(source, dict):
        raise NotConvertible("image source")
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise NotConvertible("image source")


def _tool_result(block: dict[str, Any], role: str, parts: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
    content = block.get("content")
    if role != "user":
        parts.append({"type": "text", "text": f"Tool result: {str(content) if content else ''}"})
        return
    text = ""
    images: list[str] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text":
                texts.append(item.get("text", ""))
            elif item.get("type") == "image":
                images.append(_image_url(item.get("source", {})))
            elif item.get("type") == "tool_reference":
                raise NotConvertible("tool_reference")
        text = "\n".join(texts)
    elif content is not None:
        raise NotConvertible("tool_result content")
    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text or ""})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})


def _output_config(config: Any, chat: dict[str, Any]) -> None:
    if config is None:
        return
    if not isinstance(config, dict):
        raise NotConvertible("output_config")
    fmt = config.get("format")
    if isinstance(fmt, dict) and fmt.get("json_schema"):
        chat["response_format"] = {
            "type": fmt.get("type"),
            "json_schema": {"schema": fmt["json_schema"], "name": fmt.get("type")},
        }
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]


def _thinking(thinking: Any, chat: dict[str, Any]) -> None:
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "adaptive"):
        raise NotConvertible("thinking")  # "disabled": vLLM asks the template for the effort
    if thinking["type"] == "enabled":
        chat["thinking_token_budget"] = thinking.get("budget_tokens")


def _tools(tools: Any, choice: Any, chat: dict[str, Any]) -> None:
    if choice is not None:
        if not isinstance(choice, dict):
            raise NotConvertible("tool_choice")
        chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
        kind = choice.get("type")
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "none"):
            chat["tool_choice"] = kind
        elif kind == "any":
            chat["tool_choice"] = "required"
        else:
            raise NotConvertible("tool_choice")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise NotConvertible("tools")
    converted = []
    for tool in tools:
        if not isinstance(tool, dict) or "name" not in tool:
            raise NotConvertible("tool")
        function = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("input_schema"),
            "strict": tool.get("strict"),
            "defer_loading": tool.get("defer_loading"),
        }
        converted.append({"type": "function", "function": function})
    chat.setdefault("tool_choice", "auto")
    chat["tools"] = converted
