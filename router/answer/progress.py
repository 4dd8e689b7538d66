"""The answer so far across its legs: what the router needs to resume it and account for it."""

from __future__ import annotations

from array import array

from router.engine.wire import MalformedChunk


class OverBudget(MalformedChunk):
    """An engine sent more tokens than the client's max_tokens: it is broken, and the answer
    must not pass as a success (the leg fails; the client gets an error)."""


# Generated text pieces joined into one block at a time.
_TEXT_BLOCK_PARTS = 256


class Answer:
    """One client answer's tokens and text so far, and how its current leg ended.

    `prompt_token_ids`: the spec's, else the first non-resume leg's; `generated_token_ids`
    and `generated_text`: across legs; `finish_reason`, `stop_reason`, `leg_tokens`: the
    current leg's; `legs`: legs begun so far.
    """

    def __init__(self, prompt_token_ids: list[int] | None, max_tokens: int | None = None):
        self.prompt_token_ids = prompt_token_ids
        # The client's budget: an engine that sends more ignored it (a broken engine).
        self.max_tokens = max_tokens
        # Compact: 8 bytes a token instead of a list entry and an int object (~36 bytes),
        # and the text in blocks of _TEXT_BLOCK_PARTS pieces: an answer's state is kept
        # for resumption, and it should cost little next to the bounded stream buffers.
        self.generated_token_ids: array[int] = array("q")
        self._text_blocks: list[str] = []
        self._text_parts: list[str] = []
        self._text_cache: str | None = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.leg_tokens = 0
        self.first_token_seen = False
        # False once a leg generated tokens whose ids were not sent (vLLM hides them in chat
        # streams when a reasoning parser runs with include_reasoning false): then
        # generated_token_ids is incomplete and the answer cannot be resumed from it.
        self.token_ids_complete = True
        self.legs = 0

    @property
    def generated_text(self) -> str:
        if self._text_cache is None:
            self._text_cache = "".join(self._text_blocks) + "".join(self._text_parts)
        return self._text_cache

    def begin_leg(self) -> None:
        self.legs += 1
        self.leg_tokens = 0
        self.finish_reason = None
        self.stop_reason = None

    def add_token_ids(self, ids: list[int]) -> None:
        budget = self.max_tokens
        if budget is not None and len(self.generated_token_ids) + len(ids) > budget:
            raise OverBudget(f"the engine sent more tokens than max_tokens ({budget})")
        try:
            self.generated_token_ids.extend(ids)
        except OverflowError:
            raise MalformedChunk("upstream chunk: a token id does not fit 64 bits") from None
        self.leg_tokens += len(ids)
        self.first_token_seen = True

    def add_text(self, text: str) -> None:
        parts = self._text_parts
        parts.append(text)
        if len(parts) >= _TEXT_BLOCK_PARTS:
            self._text_blocks.append("".join(parts))
            parts.clear()
        self._text_cache = None
        self.first_token_seen = True

    def note_finish(self, finish_reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason

    def note_engine_count(self, completion_tokens: int | None) -> None:
        """The leg's usage says how many tokens it generated. More than the ids it sent:
        some were hidden (chat with a reasoning parser and include_reasoning false), and the
        engine's count is then the only one."""
        if completion_tokens is not None and completion_tokens > self.leg_tokens:
            self.leg_tokens = completion_tokens
            self.token_ids_complete = False
