"""The /tokenize leg (router/engine/tokenize.py): the body renders the prompt exactly as the
engine will (the chat template's inputs included), the answer is checked, and the cache
answers a prompt seen before without a call."""

from __future__ import annotations

from typing import Any

import pytest

from router.engine.errors import UpstreamError
from router.engine.tokenize import PromptTokenizer, token_ids_of, tokenize_body


def test_a_chat_body_keeps_every_field_the_template_reads() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "temperature": 0.3,  # sampling: not the prompt's business
        "max_tokens": 5,
    }
    out = tokenize_body(True, body, "m")
    assert out == {
        "messages": body["messages"],
        "tools": body["tools"],
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "model": "m",
    }


def test_a_completion_body_is_its_prompt_and_special_tokens() -> None:
    assert tokenize_body(False, {"prompt": "hello", "add_special_tokens": False, "n": 2}, None) == {
        "prompt": "hello",
        "add_special_tokens": False,
    }


def test_prompts_that_are_not_one_text_are_not_tokenized() -> None:
    assert tokenize_body(False, {"prompt": ["a", "b"]}, "m") is None  # a batch
    assert tokenize_body(False, {"prompt": [1, 2, 3]}, "m") is None  # token ids already
    assert tokenize_body(True, {"messages": "not a list"}, "m") is None


def test_an_answer_without_token_ids_is_a_protocol_error() -> None:
    assert token_ids_of({"count": 2, "tokens": [5, 6]}, "e") == (5, 6)
    for bad in ({"count": 0}, {"tokens": ["a"]}, {"tokens": [1, True]}):
        with pytest.raises(UpstreamError, match="without a list of token ids"):
            token_ids_of(bad, "e")


class _Engine:
    """An engine's /tokenize answering from a fixed table, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def post_json(self, backend: str, base_url: str, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        assert path == "/tokenize"
        self.calls += 1
        return {"count": 3, "tokens": [len(body["prompt"]), 1, 2]}


async def test_the_cache_answers_a_prompt_seen_before_and_stays_bounded() -> None:
    engine = _Engine()
    tok = PromptTokenizer(engine, max_entries=2)  # type: ignore[arg-type]
    assert await tok.token_ids("e", "http://e", {"prompt": "abc"}) == (3, 1, 2)
    assert await tok.token_ids("e", "http://e", {"prompt": "abc"}) == (3, 1, 2)
    assert (engine.calls, tok.calls, tok.hits) == (1, 1, 1)
    await tok.token_ids("e", "http://e", {"prompt": "de"})
    await tok.token_ids("e", "http://e", {"prompt": "fgh1"})  # evicts the least recent: "abc"
    await tok.token_ids("e", "http://e", {"prompt": "abc"})
    assert engine.calls == 4


async def test_the_cache_is_bounded_in_token_ids_too() -> None:
    """Entries are evicted, least recent first, once the ids held pass `max_cached_ids`;
    a prompt of more than a quarter of it is not kept at all."""
    engine = _Engine()
    tok = PromptTokenizer(engine, max_cached_ids=40)  # type: ignore[arg-type]
    for p in ("a" * 7, "b" * 8, "c" * 9):  # 3 ids each (the table's answer)
        await tok.token_ids("e", "http://e", {"prompt": p})
    assert tok._cached_ids == 9
    for i in range(20):
        await tok.token_ids("e", "http://e", {"prompt": f"p{i}"})
    assert tok._cached_ids <= 40
    assert len(tok._cache) == 13
    assert await tok.token_ids("e", "http://e", {"prompt": "p19"}) == (3, 1, 2)
    assert tok.hits == 1
