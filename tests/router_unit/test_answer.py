"""router/answer/progress.py: the answer so far across legs."""

from __future__ import annotations

import pytest

from router.answer.progress import Answer
from router.engine.wire import MalformedChunk


def test_tokens_and_text_accumulate_across_legs_and_leg_state_resets():
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


def test_text_kept_in_blocks_reads_whole():
    a = Answer(None)
    for i in range(1000):
        a.add_text(str(i % 10))
    assert a.generated_text == "".join(str(i % 10) for i in range(1000))


def test_engine_count_beyond_the_ids_marks_them_incomplete():
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


def test_a_token_id_beyond_64_bits_is_a_protocol_error():
    with pytest.raises(MalformedChunk):
        Answer(None).add_token_ids([2**64])
