"""Logprobs across legs: completion text offsets rebased, resume legs' logprobs in chat form,
completion logprobs accumulated for a non-streaming answer."""

from __future__ import annotations

from typing import Any


def has_logprob_entries(lp: Any) -> bool:
    """Logprobs that cover at least one token (an empty object covers none)."""
    return isinstance(lp, dict) and bool(lp.get("tokens") or lp.get("content"))


class TextOffsets:
    """Completion logprobs' `text_offset` continued across legs (each leg counts from 0)."""

    def __init__(self) -> None:
        self._base = 0  # text_offset of this leg's start
        self._end = 0  # end of the text covered by logprobs so far

    def begin_leg(self) -> None:
        self._base = self._end

    def rebase(self, lp: dict[str, Any]) -> dict[str, Any]:
        """Shift this leg's text offsets by the text of the legs before it, and track the end
        (vLLM's own rule: next offset = last offset + len(last token))."""
        offsets = lp.get("text_offset")
        tokens = lp.get("tokens")
        if offsets:
            base = self._base
            if base:
                offsets = lp["text_offset"] = [o + base for o in offsets]
            if tokens and isinstance(tokens[-1], str):
                self._end = offsets[-1] + len(tokens[-1])
        return lp


def chat_logprobs_from_completion(lp: dict[str, Any], top_logprobs: int) -> list[dict[str, Any]]:
    """Completion logprobs (a resume leg) as chat `logprobs.content` entries.

    vLLM's completion top_logprobs hold top_logprobs + 1 entries (the sampled token
    first when it is outside the top), the chat ones exactly top_logprobs, from the same
    ordered map, so the first top_logprobs entries are the chat list."""
    k = top_logprobs
    out: list[dict[str, Any]] = []
    tops = lp.get("top_logprobs") or ()
    lps = lp.get("token_logprobs") or ()
    for i, tok in enumerate(lp.get("tokens") or ()):
        lpv = lps[i] if i < len(lps) else None
        top = tops[i] if i < len(tops) else None
        entry = {
            "token": tok,
            "logprob": -9999.0 if lpv is None else lpv,
            "bytes": list(tok.encode("utf-8", "replace")),
            "top_logprobs": [
                {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}
                for j, (t, v) in enumerate(top.items())
                if j < k
            ]
            if isinstance(top, dict)
            else [],
        }
        out.append(entry)
    return out


class CompletionLogprobs:
    """A completion answer's logprobs over its legs (the parallel lists vLLM returns)."""

    def __init__(self) -> None:
        self.seen = False
        self._offsets: list[int] = []
        self._token_logprobs: list[Any] = []
        self._tokens: list[str] = []
        self._top: list[Any] = []

    def add(self, lp: Any) -> None:
        if not isinstance(lp, dict):
            return
        self.seen = True
        self._offsets.extend(lp.get("text_offset") or ())
        self._token_logprobs.extend(lp.get("token_logprobs") or ())
        self._tokens.extend(lp.get("tokens") or ())
        self._top.extend(lp.get("top_logprobs") or ())

    def as_dict(self) -> dict[str, Any] | None:
        if not self.seen:
            return None
        return {
            "text_offset": self._offsets,
            "token_logprobs": self._token_logprobs,
            "tokens": self._tokens,
            "top_logprobs": self._top,
        }
