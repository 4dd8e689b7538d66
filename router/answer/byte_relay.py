"""The answer's plain token chunks relayed on their bytes: one, a run, or a read's whole chunks.

`ResponseShaper` (router/answer/shaper.py) parses and rewrites the chunks where something
is decided; these three relay the rest through router/answer/chunk_bytes.py, with the
answer kept as the full path would keep it (router/answer/progress.py): the same client
bytes, no parse. Each returns None where the chunks must go the full path.
"""

from __future__ import annotations

from typing import Any

from router.admission.spec import RequestSpec
from router.answer.assembly import ResponseAssembler
from router.answer.chunk_bytes import PlainChunks, read_compact
from router.answer.progress import Answer, RunReader


class ByteRelay:
    """The byte paths of one client answer's shaper (its state is the shaper's)."""

    spec: RequestSpec
    answer: Answer
    emitted: bool
    _plain: PlainChunks | None  # the current leg's relay, from its first chunk
    _pending: list[dict[str, Any]]  # chunks to send before anything else
    _want_ids: bool
    _prompt_ids_sent: bool
    _accumulate: bool
    _assembler: ResponseAssembler
    _chat: bool
    _is_resume: bool

    def shape_raw(self, payload: bytes) -> bytes | None:
        """A plain token chunk's bytes -> the client's SSE event (b"" for a non-streaming client),
        with the answer updated as `shape` would; None when it must be parsed and `shape`d."""
        plain, answer = self._relay(), self.answer
        if plain is None or (relayed := plain.relay(payload)) is None:
            return None
        event, text, ids = relayed
        answer.add_token_ids(ids)
        if text:
            answer.add_text(text)
        if self._accumulate:  # a non-streaming client's answer: accumulated only
            self._assembler.add_plain(text, chat_leg=self._chat and not self._is_resume)
            return b""
        self.emitted = True
        return event

    def shape_run(self, payloads: list[bytes]) -> bytes | None:
        """`shape_raw` for a run of plain token chunks at once (b"" for a non-streaming
        client), or None: each then goes through `shape_raw` (or `shape`)."""
        plain = self._relay()
        if plain is None or not self.answer.room_for(len(payloads)):
            return None  # one by one: past the budget, the chunk that crosses it fails
        if (relayed := plain.relay_run(payloads)) is None:
            return None
        event, block = relayed
        return self._add_run(read_compact, event, block, len(payloads))

    def shape_chunked(self, data: bytes) -> tuple[bytes, int, int] | None:
        """`shape_run` for the whole plain token chunks a read of the leg's chunked body
        begins with (`PlainChunks.relay_chunked`): (the client's events, b"" for a
        non-streaming client; the bytes of `data` they were; their count), or None: the read
        is read the usual way."""
        plain = self._relay()
        if plain is None or (relayed := plain.relay_chunked(data)) is None:
            return None
        event, block, n, taken = relayed
        if not self.answer.room_for(n):
            return None
        return self._add_run(read_compact, event, block, n), taken, n

    def _add_run(self, reader: RunReader, event: bytes, block: bytes, n: int) -> bytes:
        self.answer.add_run(reader, block, n)
        if self._accumulate:  # the run's text at once: what `add_plain` per chunk would keep
            self._assembler.add_plain(reader(block)[0], chat_leg=self._chat and not self._is_resume)
            return b""
        self.emitted = True
        return event

    def _relay(self) -> PlainChunks | None:
        # Not while prompt ids the client asked for are owed: they ride on the next chunk out.
        owes_ids = self._want_ids and not self._prompt_ids_sent and self.answer.prompt_token_ids is not None
        return None if self._pending or owes_ids else self._plain
