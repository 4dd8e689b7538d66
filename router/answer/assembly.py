"""A non-streaming client's answer: every leg's chunks accumulated into the JSON vLLM 0.32
returns for the same request with `stream: false`.

The body has every field that `model_dump()` writes, nulls included. Not reproducible
from streams, hence null: `prompt_logprobs` (admission rejects the option), `prompt_text`,
`metrics` (per-request timing, only with an engine flag), `kv_transfer_params` (internal,
never shown to clients), `routed_experts`.
"""

from __future__ import annotations

from typing import Any

from router.admission.spec import RequestSpec
from router.answer.logprobs import CompletionLogprobs, chat_logprobs_from_completion
from router.answer.progress import Answer


class ResponseAssembler:
    """Collects content, reasoning, tool calls and logprobs; `response` builds the body."""

    def __init__(self, spec: RequestSpec, answer: Answer, *, chat: bool, chat_top_logprobs: int | None):
        self._spec = spec
        self._answer = answer
        self._chat = chat
        self._chat_top_logprobs = chat_top_logprobs
        self._role: str | None = None
        self._content_parts: list[str] = []
        self._content_seen = False
        self._reasoning_parts: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._chat_lp_seen = False
        self._chat_lp_content: list[dict[str, Any]] = []
        self._completion_lp = CompletionLogprobs()

    # --- accumulation ------------------------------------------------------------------------
    def add_completion(self, text: str, lp: dict[str, Any] | None) -> None:
        """A chunk of a completion stream (a completions client's, or a resume leg's)."""
        if text:
            self._content_parts.append(text)
        if self._chat:
            if lp is not None:
                self._chat_lp_seen = True
                self._chat_lp_content.extend(chat_logprobs_from_completion(lp, self._chat_top_logprobs or 0))
        else:
            self._completion_lp.add(lp)

    def add_plain(self, text: str, *, chat_leg: bool) -> None:
        """A token chunk with only text in it (read on its bytes: router/answer/chunk_bytes.py)."""
        if chat_leg:
            self.add_chat(None, text, None, None, None)
        else:
            self.add_completion(text, None)

    def add_chat(self, role: Any, content: Any, reasoning: Any, tool_calls: Any, lp: Any) -> None:
        """A chunk of a chat stream: its delta's fields and its logprobs."""
        if role is not None:
            if self._role is None:
                self._role = role
        elif content is not None:
            self._content_seen = True
        if content:
            self._content_parts.append(content)
        if reasoning:
            self._reasoning_parts.append(reasoning)
        if tool_calls:
            self._add_tool_calls(tool_calls)
        if isinstance(lp, dict):
            self._chat_lp_seen = True
            lc = lp.get("content")
            if lc:
                self._chat_lp_content.extend(lc)

    def _add_tool_calls(self, deltas: list[Any]) -> None:
        """Tool call deltas merged by index: the first id and name, the arguments joined."""
        for d in deltas:
            if not isinstance(d, dict):
                continue
            idx = d.get("index", 0)
            tc = self._tool_calls.get(idx)
            if tc is None:
                tc = self._tool_calls[idx] = {
                    "id": None,
                    "type": "function",
                    "function": {"name": None, "arguments": ""},
                }
            if d.get("id") and tc["id"] is None:
                tc["id"] = d["id"]
            f = d.get("function")
            if isinstance(f, dict):
                if f.get("name") and tc["function"]["name"] is None:
                    tc["function"]["name"] = f["name"]
                if f.get("arguments"):
                    tc["function"]["arguments"] += f["arguments"]

    # --- the body ------------------------------------------------------------------------------
    def response(self, model: str | None, fingerprint: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        """The body vLLM 0.32 returns for this request with stream=false."""
        if self._chat:
            return self._chat_response(model, fingerprint, usage)
        return self._completion_response(model, fingerprint, usage)

    def _token_ids(self) -> tuple[list[int] | None, list[int] | None]:
        """(generated, prompt) token ids when the client asked for them."""
        a = self._answer
        if not self._spec.return_token_ids:
            return None, None
        return list(a.generated_token_ids), list(a.prompt_token_ids) if a.prompt_token_ids is not None else None

    def _completion_response(self, model: str | None, fingerprint: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        spec, a = self._spec, self._answer
        token_ids, prompt_token_ids = self._token_ids()
        choice = {
            "index": 0,
            "text": "".join(self._content_parts),
            "logprobs": self._completion_lp.as_dict(),
            "finish_reason": a.finish_reason,
            "stop_reason": a.stop_reason,
            "token_ids": token_ids,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_token_ids,
            "routed_experts": None,
        }
        return {
            "id": spec.request_id,
            "object": "text_completion",
            "created": spec.created,
            "model": model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": usage,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _chat_response(self, model: str | None, fingerprint: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        spec, a = self._spec, self._answer
        reasoning = "".join(self._reasoning_parts) if self._reasoning_parts else None
        tool_calls = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        if self._content_seen or self._content_parts:
            content: str | None = "".join(self._content_parts)
        else:
            # A reasoning/tool parser answers content null when the model wrote none.
            content = None if (reasoning is not None or tool_calls) else ""
        message: dict[str, Any] = {
            "role": self._role or "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        message["reasoning"] = reasoning
        token_ids, prompt_token_ids = self._token_ids()
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": self._chat_lp_content} if self._chat_lp_seen else None,
            "finish_reason": a.finish_reason or "stop",
            "stop_reason": a.stop_reason,
            "token_ids": token_ids,
            "routed_experts": None,
        }
        return {
            "id": spec.request_id,
            "object": "chat.completion",
            "created": spec.created,
            "model": model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_token_ids,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
