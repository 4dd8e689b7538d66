"""The simulator's tokenizer: round trip, shared-prefix property, chat template, generator."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_launcher.sim import tokenizer as tok


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_decode_inverts_encode(text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text(), st.text(), st.text(min_size=1))
def test_texts_sharing_a_prefix_share_all_but_the_last_token(a: str, b: str, c: str) -> None:
    prefix = tok.encode(a)
    for longer in (tok.encode(a + b), tok.encode(a + c)):
        # Every token of the shorter text except the last one is a prefix of the longer.
        assert longer[: max(len(prefix) - 1, 0)] == prefix[: max(len(prefix) - 1, 0)]


def test_ids_past_the_built_in_vocabulary_decode_to_placeholders() -> None:
    assert tok.decode([tok.VOCAB_SIZE - 1]) == f"<|id_{tok.VOCAB_SIZE - 1}|>"
    assert tok.is_valid_id(tok.VOCAB_SIZE - 1)
    assert not tok.is_valid_id(tok.VOCAB_SIZE)


def test_words_are_single_tokens_and_bytes_the_fallback() -> None:
    ids = tok.encode("the world")
    assert len(ids) == 2  # "the", " world"
    assert tok.token_text(ids[1]) == " world"
    assert tok.encode("\u00e9") == [0xC3 + 2, 0xA9 + 2]  # UTF-8 bytes


def test_chat_template_is_fixed() -> None:
    text = tok.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_generation_is_deterministic_per_prompt_seed_and_position() -> None:
    k1 = tok.generation_key(0, None, [5, 6, 7])
    k2 = tok.generation_key(0, None, [5, 6, 7])
    k3 = tok.generation_key(0, 42, [5, 6, 7])
    seq1 = [tok.next_token(k1, i, 0.0, True) for i in range(50)]
    seq2 = [tok.next_token(k2, i, 0.0, True) for i in range(50)]
    seq3 = [tok.next_token(k3, i, 0.0, True) for i in range(50)]
    assert seq1 == seq2
    assert seq1 != seq3
    assert tok.EOS_ID not in seq1  # eos_probability 0


def test_eos_only_when_allowed() -> None:
    k = tok.generation_key(0, None, [1, 2])
    assert tok.next_token(k, 0, 1.0, True) == tok.EOS_ID
    assert tok.next_token(k, 0, 1.0, False) != tok.EOS_ID


def test_fake_logprobs_put_the_sampled_token_first_and_descend() -> None:
    k = tok.generation_key(0, None, [1, 2])
    t = tok.next_token(k, 3, 0.0, True)
    lps = tok.fake_logprobs(k, 3, t, 4)
    assert lps[0][0] == t
    assert len(lps) == 4
    assert len({i for i, _ in lps}) == 4
    assert len(tok.fake_logprobs(k, 3, t, 0)) == 1  # logprobs=0: the sampled token only
    values = [lp for _, lp in lps]
    assert values == sorted(values, reverse=True)
    assert all(v < 0 for v in values)
