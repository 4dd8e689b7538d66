"""The answer so far across its legs: what the router needs to resume it and account for it."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import overload

from router.engine.wire import MalformedChunk


class OverBudget(MalformedChunk):
    """An engine sent more tokens than the client's max_tokens: it is broken, and the answer
    must not pass as a success (the leg fails; the client gets an error)."""


# Generated text pieces joined into one block at a time.
_TEXT_BLOCK_PARTS = 256
# Relayed runs kept on their bytes up to this much; past it they are read (a long answer's
# state stays compact: the bytes are ~25x the ids and text they hold).
_RAW_BYTES = 64 * 1024

# Reads a relayed run's bytes: (its text, its token ids).
RunReader = Callable[[bytes], tuple[str, list[int]]]


class Answer:
    """One client answer's tokens and text so far, and how its current leg ended.

    `prompt_token_ids`: the spec's, else the first non-resume leg's; `generated_token_ids`
    and `generated_text`: across legs; `finish_reason`, `stop_reason`, `leg_tokens`: the
    current leg's; `legs`: legs begun so far.

    Runs of token chunks relayed on their bytes (router/answer/chunk_bytes.py) are kept as
    those bytes and read only when the ids or the text are asked for (a resume, a whole
    answer's body): most answers never are, and reading each chunk as it went by was a
    third of a relayed token's CPU. Their count is known at once (one id a chunk).
    """

    def __init__(self, prompt_token_ids: list[int] | None, max_tokens: int | None = None):
        self.prompt_token_ids = prompt_token_ids
        # The client's budget: an engine that sends more ignored it (a broken engine).
        self.max_tokens = max_tokens
        # Compact: 8 bytes a token instead of a list entry and an int object (~36 bytes),
        # and the text in blocks of _TEXT_BLOCK_PARTS pieces: an answer's state is kept
        # for resumption, and it should cost little next to the bounded stream buffers.
        self._ids: array[int] = array("q")
        self._text_blocks: list[str] = []
        self._text_parts: list[str] = []
        self._text_cache: str | None = ""
        # Not read yet, in order: relayed runs (bytes, read by the reader before them), and
        # the ids and text added after the first of them. No tuple a run: a paced stream
        # adds one a chunk, and a tuple's allocation and its share of garbage collection
        # cost more than the rest of add_run.
        self._unread: list[RunReader | bytes | array[int] | str] = []
        self._unread_reader: RunReader | None = None
        self._unread_bytes = 0
        self.token_count = 0  # len(generated_token_ids), without reading anything
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
    def generated_token_ids(self) -> Sequence[int]:
        """Every generated id so far; its length is known without reading relayed runs."""
        return TokenIds(self) if self._unread else self._ids

    @property
    def generated_text(self) -> str:
        if self._unread:
            self._read()
        if self._text_cache is None:
            self._text_cache = "".join(self._text_blocks) + "".join(self._text_parts)
        return self._text_cache

    def read_ids(self) -> array[int]:
        if self._unread:
            self._read()
        return self._ids

    def begin_leg(self) -> None:
        self.legs += 1
        self.leg_tokens = 0
        self.finish_reason = None
        self.stop_reason = None

    def room_for(self, tokens: int) -> bool:
        """`tokens` more stay within max_tokens."""
        return self.max_tokens is None or self.token_count + tokens <= self.max_tokens

    def add_token_ids(self, ids: list[int]) -> None:
        budget = self.max_tokens
        if budget is not None and self.token_count + len(ids) > budget:
            raise OverBudget(f"the engine sent more tokens than max_tokens ({budget})")
        try:
            if self._unread:
                self._unread.append(array("q", ids))
            else:
                self._ids.extend(ids)
        except OverflowError:
            raise MalformedChunk("upstream chunk: a token id does not fit 64 bits") from None
        self.token_count += len(ids)
        self.leg_tokens += len(ids)
        self.first_token_seen = True

    def add_text(self, text: str) -> None:
        if self._unread:
            self._unread.append(text)
        else:
            self._add_text(text)
        self.first_token_seen = True

    def _add_text(self, text: str) -> None:
        parts = self._text_parts
        parts.append(text)
        if len(parts) >= _TEXT_BLOCK_PARTS:
            self._text_blocks.append("".join(parts))
            parts.clear()
        self._text_cache = None

    def add_run(self, reader: RunReader, block: bytes, tokens: int) -> None:
        """A relayed run of `tokens` chunks (one id each), read by `reader` when needed. The
        caller checked `room_for(tokens)`."""
        unread = self._unread
        if reader is not self._unread_reader or not unread:
            unread.append(reader)
            self._unread_reader = reader
        unread.append(block)
        self.token_count += tokens
        self.leg_tokens += tokens
        self.first_token_seen = True
        self._unread_bytes += len(block)
        if self._unread_bytes > _RAW_BYTES:
            self._read()

    def _read(self) -> None:
        unread, self._unread = self._unread, []
        self._unread_bytes = 0
        self._unread_reader = None
        reader: RunReader | None = None
        for item in unread:
            if type(item) is bytes:
                assert reader is not None  # a run's reader comes before it
                text, ids = reader(item)
                self._ids.extend(ids)
                if text:
                    self._add_text(text)
            elif type(item) is str:
                self._add_text(item)
            elif type(item) is array:
                self._ids.extend(item)
            else:
                reader = item  # type: ignore[assignment]  # the reader of the runs after it

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


class TokenIds(Sequence[int]):
    """An answer's generated ids with relayed runs not read yet: its length is the count,
    anything else reads them."""

    __slots__ = ("_answer",)

    def __init__(self, answer: Answer):
        self._answer = answer

    def __len__(self) -> int:
        return self._answer.token_count

    def __iter__(self) -> Iterator[int]:
        return iter(self._answer.read_ids())

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        return self._answer.read_ids()[i]
