"""The answer so far across legs (router/answer/progress.py): token ids, text, how the
current leg ended, and whether the answer can be resumed."""

from __future__ import annotations

from array import array

import pytest

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS
from router.answer.progress import Answer, OverBudget
from router.answer.shaper import ResponseShaper
from router.engine.wire import CACHE_THRESHOLD, MalformedChunk
from support.shaping import PROMPT, make_spec, split_legs, steps_for
from support.vllm_serving import (
    Gen,
    chat_stream,
)


def test_lead_state_after_a_preempted_leg() -> None:
    spec = make_spec(ENDPOINT_COMPLETIONS)
    g = Gen(PROMPT, steps_for(3, finish="stop"))
    legs = split_legs(ENDPOINT_COMPLETIONS, g, [2], [False, False], [None, None])
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    for c in legs[0][1]:
        sh.shape(c)
    assert (
        sh.answer.finish_reason,
        sh.answer.leg_tokens,
        list(sh.answer.generated_token_ids),
        sh.answer.prompt_token_ids,
    ) == (CACHE_THRESHOLD, 2, [1000, 1001], PROMPT)
    sh.begin_leg(is_resume=True)
    assert (sh.answer.finish_reason, sh.answer.leg_tokens) == (None, 0)
    for c in legs[1][1]:
        sh.shape(c)
    assert (sh.answer.finish_reason, sh.answer.leg_tokens, len(sh.answer.generated_token_ids)) == ("stop", 1, 3)
    assert sh.answer.prompt_token_ids == PROMPT  # not the resume leg's prompt


def test_hidden_token_ids_make_the_answer_unresumable() -> None:
    spec = make_spec(ENDPOINT_CHAT)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    sh.shape(chat_stream(Gen(PROMPT, []))[0])
    assert sh.answer.token_ids_complete
    # vLLM with a reasoning parser and include_reasoning false: token_ids null in the chunks.
    sh.shape(
        {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "tiny",
            "choices": [
                {"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None, "token_ids": None}
            ],
        }
    )
    assert not sh.answer.token_ids_complete
    sh2 = ResponseShaper(spec)
    sh2.begin_leg(is_resume=False)
    for c in chat_stream(Gen(PROMPT, steps_for(2))):
        sh2.shape(c)
    assert sh2.answer.token_ids_complete
    assert sh2.answer.leg_tokens == 2


def test_tokens_and_text_accumulate_across_legs_and_leg_state_resets() -> None:
    a = Answer([1, 2])
    a.begin_leg()
    a.add_token_ids([7, 8])
    a.add_text("ab")
    a.note_finish("cache_threshold", None)
    assert (a.leg_tokens, a.finish_reason, a.first_token_seen, a.legs) == (2, "cache_threshold", True, 1)
    a.begin_leg()
    assert (a.leg_tokens, a.finish_reason, a.stop_reason, a.legs) == (0, None, None, 2)
    a.add_token_ids([9])
    a.add_text("c")
    assert list(a.generated_token_ids) == [7, 8, 9]
    assert a.generated_text == "abc"
    assert a.prompt_token_ids == [1, 2]
    assert a.token_ids_complete


def test_text_kept_in_blocks_reads_whole() -> None:
    a = Answer(None)
    for i in range(1000):
        a.add_text(str(i % 10))
    assert a.generated_text == "".join(str(i % 10) for i in range(1000))


def test_engine_count_beyond_the_ids_marks_them_incomplete() -> None:
    a = Answer(None)
    a.begin_leg()
    a.add_token_ids([1, 2])
    a.note_engine_count(2)
    assert a.token_ids_complete
    assert a.leg_tokens == 2
    a.note_engine_count(None)
    assert a.token_ids_complete
    a.note_engine_count(5)
    assert not a.token_ids_complete
    assert a.leg_tokens == 5


def test_a_token_id_beyond_64_bits_is_a_protocol_error() -> None:
    with pytest.raises(MalformedChunk):
        Answer(None).add_token_ids([2**64])


def test_tokens_past_the_budget_are_refused_before_they_count() -> None:
    a = Answer([1, 2], max_tokens=3)
    a.add_token_ids([10, 11])
    with pytest.raises(OverBudget, match="max_tokens"):
        a.add_token_ids([12, 13])
    assert list(a.generated_token_ids) == [10, 11]
    a.add_token_ids([12])
    assert a.leg_tokens == 3


def read_words(block: bytes) -> tuple[str, list[int]]:
    """A stand-in run reader: `b"w:1,w:2"` is the text "ww" and the ids [1, 2]."""
    pairs = [p.split(b":") for p in block.split(b",")]
    return b"".join(t for t, _ in pairs).decode(), [int(i) for _, i in pairs]


def test_runs_are_counted_at_once_and_read_in_order_only_when_asked() -> None:
    reads: list[bytes] = []

    def reader(block: bytes) -> tuple[str, list[int]]:
        reads.append(block)
        return read_words(block)

    a = Answer(None, max_tokens=10)
    a.begin_leg()
    a.add_token_ids([1])
    a.add_text("a")
    a.add_run(reader, b"b:2,c:3", 2)
    a.add_token_ids([4])
    a.add_text("d")
    a.add_run(reader, b"e:5", 1)
    assert (a.token_count, a.leg_tokens, len(a.generated_token_ids), a.first_token_seen) == (5, 5, 5, True)
    assert reads == []
    assert a.room_for(5)
    assert not a.room_for(6)
    assert a.generated_text == "abcde"
    assert list(a.generated_token_ids) == [1, 2, 3, 4, 5]
    assert a.generated_token_ids[1:3] == array("q", [2, 3])
    assert reads == [b"b:2,c:3", b"e:5"]
    a.add_token_ids([6])
    assert list(a.generated_token_ids) == [1, 2, 3, 4, 5, 6]
    assert reads == [b"b:2,c:3", b"e:5"]  # read once


def test_runs_past_a_size_are_read_at_once_to_stay_compact() -> None:
    a = Answer(None)
    block = b",".join(b"x:%d" % i for i in range(20000))  # > 64 KiB
    a.add_run(read_words, block, 20000)
    assert type(a.generated_token_ids) is array  # nothing left to read
    assert len(a.generated_text) == 20000


def test_a_token_id_beyond_64_bits_after_a_run_is_still_a_protocol_error() -> None:
    a = Answer(None)
    a.add_run(read_words, b"x:1", 1)
    with pytest.raises(MalformedChunk):
        a.add_token_ids([2**64])
