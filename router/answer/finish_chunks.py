"""Finish chunks across legs: a chunk without its finish, and the content-free finish a split leaves.

The shaper holds every finish chunk back until it knows the answer ends there (the lead
may resume it on another engine; vLLM puts the fingerprint on the last chunk): `shape`
returns nothing for it and keeps it, `release_held()` (or `final_chunks()`) returns it. A
finish that turns out not to be the end goes on without its finish, the content it carried
before the next leg's first chunk; a "cache_threshold" finish that carries content (only
non-vLLM engines send one) is split at once: the content goes out, and a finish chunk with
no content is what is held (router/answer/shaper.py). A normal finish is followed upstream
by the usage chunk and [DONE] at once: holding it costs no latency.
"""

from __future__ import annotations

from typing import Any


def without_finish(chunk: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """`chunk` (changed in place) as a chunk that does not end the answer."""
    c = chunk["choices"][0]
    c["finish_reason"] = None
    if chat:
        # vLLM's chat chunks carry stop_reason on the finish chunk only.
        c.pop("stop_reason", None)
    elif "stop_reason" in c:
        c["stop_reason"] = None
    return chunk


def content_free_finish(chunk: dict[str, Any], *, chat: bool, want_ids: bool) -> dict[str, Any]:
    """A copy of finish chunk `chunk` without its content (text or delta, logprobs, token
    ids, prompt ids), as vLLM shapes an empty chunk for the client's endpoint."""
    finish = dict(chunk)
    fc = dict(chunk["choices"][0])
    if chat:
        fc["delta"] = {"content": ""}
        fc["logprobs"] = None
    else:
        fc["text"] = ""
        fc["logprobs"] = None
        if "prompt_token_ids" in fc:
            fc["prompt_token_ids"] = None
    if "token_ids" in fc:
        fc["token_ids"] = [] if want_ids else None
    finish["choices"] = [fc]
    if "prompt_token_ids" in finish:
        finish["prompt_token_ids"] = None  # chat: top level; sent with the content part
    return finish
