"""Workload synthesis and the oracle: deterministic, exact in simulator tokens."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from bench.workloads import generators as wl
from engine_launcher.sim import tokenizer as simtok


def _trace(tmp_path: Path, records: list[dict[str, Any]]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


RECORDS = [
    {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 500, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 1000, "input_length": 700, "output_length": 7, "hash_ids": [4, 5]},
    {"timestamp": 1500, "input_length": 512, "output_length": 1, "hash_ids": [1]},
]


def test_words_text_is_deterministic_and_exact() -> None:
    a = wl.words_text(50, "k", 1)
    assert a == wl.words_text(50, "k", 1)
    assert a != wl.words_text(50, "k", 2)
    assert wl.token_count(a) == 50
    assert len(simtok.encode(a + wl.words_text(13, "x"))) == 63


def test_mooncake_synthesis_exact_counts_and_shared_prefixes(tmp_path: Path) -> None:
    recs = wl.load_trace(_trace(tmp_path, RECORDS))
    reqs = wl.mooncake_requests(recs, block_tokens=32, time_scale=0.5)
    assert [r.prompt_tokens for r in reqs] == [64, 81, 44, 32]
    for r in reqs:
        assert wl.token_count(r.prompt) == r.prompt_tokens
    # Equal hash ids give equal text: request 1 starts with request 0 entirely.
    assert reqs[1].prompt.startswith(reqs[0].prompt)
    assert reqs[0].prompt.startswith(reqs[3].prompt)
    assert not reqs[2].prompt.startswith(reqs[0].prompt[:20])
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 0.5, 0.75]
    assert [r.max_tokens for r in reqs] == [10, 5, 7, 1]
    again = wl.mooncake_requests(recs, block_tokens=32, time_scale=0.5)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    assert wl.mooncake_requests(recs, block_tokens=32, seed=1)[0].prompt != reqs[0].prompt
    capped = wl.mooncake_requests(recs, block_tokens=32, output_scale=0.5, max_output=3)
    assert [r.max_tokens for r in capped] == [3, 2, 3, 1]


def test_prefix_groups_and_sessions_deterministic() -> None:
    a = wl.prefix_group_requests(groups=3, per_group=4, system_tokens=40, question_tokens=8, rate=10, seed=3)
    b = wl.prefix_group_requests(groups=3, per_group=4, system_tokens=40, question_tokens=8, rate=10, seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert len(a) == 12
    assert all(wl.token_count(r.prompt) == 48 == r.prompt_tokens for r in a)
    assert sorted({r.tag for r in a}) == ["g0", "g1", "g2"]
    assert all(x.arrival_s <= y.arrival_s for x, y in itertools.pairwise(a))
    by_group: dict[str, set[str]] = {}
    for r in a:
        by_group.setdefault(r.tag, set()).add(r.prompt[:200])
    assert all(len(v) == 1 for v in by_group.values())  # a group shares its system prompt
    s1 = wl.multiturn_sessions(sessions=2, turns=3, system_tokens=16, message_tokens=4, seed=1)
    s2 = wl.multiturn_sessions(sessions=2, turns=3, system_tokens=16, message_tokens=4, seed=1)
    assert [s.messages for s in s1] == [s.messages for s in s2]


def test_poisson_arrivals() -> None:
    t = wl.poisson_arrivals(2000, 50.0, seed=1)
    assert t[0] == 0.0
    assert t == sorted(t)
    assert 35 < 2000 / t[-1] < 65
    assert wl.poisson_arrivals(3, 0) == [0.0, 0.0, 0.0]


def test_oracle_counts_whole_blocks_and_leaves_the_last_token() -> None:
    bs = 4
    a = list(range(10))  # 2 full blocks + 2 tokens
    b = [*range(10), 99, 98]  # shares a's 2 full blocks and more
    c = list(range(8))  # exactly 2 blocks: at most (8-1)//4 = 1 block can hit
    d = [7, *range(9)]  # no shared prefix
    hits, total, per = wl.oracle_hit_tokens([(a, None), (b, None), (c, None), (d, None)], bs)
    assert per == [0, 8, 4, 0]
    assert total == 10 + 12 + 8 + 10
    assert hits == 12
    # Blocks cached after a request (its answer) count for later prompts.
    _hits2, _, per2 = wl.oracle_hit_tokens([(a[:4], a), ([*a, 1], None)], bs)
    assert per2 == [0, 8]


def test_oracle_for_trace_requests(tmp_path: Path) -> None:
    reqs = wl.mooncake_requests(wl.load_trace(_trace(tmp_path, RECORDS)), block_tokens=32)
    o = wl.oracle_for_requests(reqs, 16)
    # Request 1 hits both blocks of request 0 (64 tokens); request 3 hits 16 of its 32
    # (the last block holds its last token).
    assert o["per_request"] == [0, 64, 0, 16]
    assert o["prompt_tokens"] == 64 + 81 + 44 + 32
    assert abs(o["oracle_hit_ratio"] - 80 / 221) < 1e-9
