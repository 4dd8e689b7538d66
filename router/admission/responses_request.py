"""The chat completion that stands for a Responses API body (`POST /v1/responses`) in the
probe race.

vLLM 0.32 renders a text model's Responses request through the chat template: the
`instructions` as a system message, then the `input` (a string: one user message; or
message items). The router races a one-token chat completion of those messages; the
engine that accepts it holds the prompt, and the client's own body then goes there
(router/server/responses.py). The probe only chooses the engine, the answer is always the
engine's own: a body whose prompt this does not reproduce (function call items, images,
`previous_response_id`, a `developer` turn) is not raced but sent to the least loaded
engine, as before.
"""

from __future__ import annotations

from typing import Any

_ROLES = ("user", "assistant", "system")


def probe_chat_body(body: dict[str, Any]) -> dict[str, Any] | None:
    """The chat body whose prompt is this request's, or None."""
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        return None  # the prompt includes a stored conversation only the engine knows
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            return None
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            message = _message(item)
            if message is None:
                return None
            messages.append(message)
    else:
        return None
    chat: dict[str, Any] = {"messages": messages, "max_tokens": 1}
    if isinstance(body.get("model"), str):
        chat["model"] = body["model"]
    return chat


def _message(item: Any) -> dict[str, Any] | None:
    if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in _ROLES:
        return None
    content = item.get("content")
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        content = "".join(texts)
    if not isinstance(content, str):
        return None
    return {"role": item["role"], "content": content}
