"""The generated Mooncake-format conversation trace: deterministic, multi-turn prefix structure,
lengths and times in their ranges, usable by the replay."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

from bench.workloads import generators as wl
from bench.workloads import trace_gen as tg
from engine_launcher.sim import tokenizer as simtok

P = tg.TraceParams(seed=3, duration_s=300.0)


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    assert tg.generate(P) == tg.generate(P)
    assert tg.generate(replace(P, seed=4)) != tg.generate(P)


def test_records_are_mooncake_format_in_time_order_within_the_duration() -> None:
    recs = tg.generate(P)
    assert len(recs) > 300
    assert [r["timestamp"] for r in recs] == sorted(r["timestamp"] for r in recs)
    assert all(0 <= r["timestamp"] < P.duration_s * 1000 for r in recs)
    for r in recs:
        assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / tg.TRACE_BLOCK)
        assert P.min_input <= r["input_length"] <= P.max_input
        assert P.output_tokens[0] <= r["output_length"] <= P.output_tokens[1]


def test_next_turn_extends_the_previous_prompt_and_answer_after_a_think_time() -> None:
    convs = tg.conversations(P)
    multi = [c for c in convs if len(c) > 1]
    single = [c for c in convs if len(c) == 1]
    assert multi
    assert single
    # single_turn_share 0.4; with short think times no turn falls past the end of the trace.
    brief = tg.conversations(replace(P, think_s=(1.0, 2.0)))
    assert 0.3 < sum(len(c) == 1 for c in brief) / len(brief) < 0.5
    firsts = [c[0]["input_length"] for c in convs]
    # Heavy tail: most first prompts are short, some are long.
    assert sorted(firsts)[len(firsts) // 2] < 4000
    assert max(firsts) > 12000
    for c in multi:
        for prev, nxt in itertools.pairwise(c):
            whole = prev["input_length"] // tg.TRACE_BLOCK
            assert nxt["hash_ids"][:whole] == prev["hash_ids"][:whole]
            # The previous answer and a new message: at least the answer plus the shortest message.
            assert nxt["input_length"] >= prev["input_length"] + prev["output_length"] + P.message_tokens[0]
            # A partial last block changes when the prompt grows: it gets a new id.
            if prev["input_length"] % tg.TRACE_BLOCK:
                assert nxt["hash_ids"][whole] != prev["hash_ids"][whole]
            think = (nxt["timestamp"] - prev["timestamp"]) / 1000
            assert P.think_s[0] - 0.002 <= think <= P.think_s[1] + 0.002


def test_ids_are_shared_only_within_a_conversation_or_a_shared_prefix() -> None:
    convs = tg.conversations(P)
    owners: dict[int, set[int]] = {}
    for i, c in enumerate(convs):
        for rec in c:
            for h in rec["hash_ids"]:
                owners.setdefault(h, set()).add(i)
    shared = {h for h, o in owners.items() if len(o) > 1}
    # Ids used by several conversations are the shared prefixes' (at most shared_prefix_blocks each).
    assert len(shared) <= P.shared_prefixes * P.shared_prefix_blocks[1]
    for c in convs:
        ids = c[0]["hash_ids"]
        k = sum(1 for h in ids if h in shared)
        assert ids[:k] == [h for h in ids if h in shared]  # shared ids only lead a prompt


def test_head_has_little_reuse_the_whole_trace_more() -> None:
    recs = tg.generate(tg.TraceParams())
    head, whole = tg.describe(recs, 400), tg.describe(recs)
    assert head["block_hit_ratio"] < 0.35 < whole["block_hit_ratio"]


def test_cached_trace_is_written_once_and_replays(tmp_path: Path) -> None:
    path = tg.cached_trace(P, tmp_path)
    assert path.parent == tmp_path
    assert path.exists()
    mtime = path.stat().st_mtime_ns
    assert tg.cached_trace(P, tmp_path) == path
    assert path.stat().st_mtime_ns == mtime
    assert tg.cached_trace(replace(P, seed=9), tmp_path) != path
    recs = wl.load_trace(path)
    assert recs == tg.generate(P)
    # The replay turns a later turn into a prompt that starts with the previous turn's whole blocks.
    conv = next(c for c in tg.conversations(P) if len(c) > 1 and c[0]["input_length"] >= 2 * tg.TRACE_BLOCK)
    reqs = wl.mooncake_requests(conv, block_tokens=32)
    whole = conv[0]["input_length"] // tg.TRACE_BLOCK * 32
    first, second = simtok.encode(reqs[0].prompt), simtok.encode(reqs[1].prompt)
    assert second[:whole] == first[:whole]
    assert len(second) > len(first)
    assert wl.oracle_for_requests(reqs, 16)["per_request"][1] >= whole
