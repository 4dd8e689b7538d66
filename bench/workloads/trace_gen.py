"""A deterministic Mooncake-format trace of multi-turn conversations: `python -m bench.workloads.trace_gen`.

The benchmarks replay Mooncake-format traces (docs/BENCHMARKS.md). A clone of the repository
has no trace, so this module writes one from a seed. It has the structure that makes routing
matter in the real Mooncake trace, with every parameter in `TraceParams`:

- conversations start as a Poisson process (`conversation_rate` per second); the trace ends
  at `duration_s` (later turns are left out);
- a share of them (`single_turn_share`) is a single request; the others have 2 or more turns
  (1 + a geometric number of extra turns, mean `mean_extra_turns`, at most `max_turns`);
- turn k+1 arrives a think time after turn k (log-uniform in `think_s`, tens of seconds to
  minutes); its prompt is turn k's prompt, turn k's answer and a new user message, so its
  `hash_ids` repeat turn k's *whole* blocks and continue with new ids (a partial last block
  changes when the prompt grows, so it gets a new id, as a block hash would);
- first-turn prompts follow a bounded Pareto law on [`min_input`, `max_input`] tokens with
  shape `input_alpha` (heavy tail: most prompts are short, a few are very long); user
  messages are log-uniform in `message_tokens`; a conversation ends when its next prompt
  would exceed `max_input`;
- a share of conversations (`shared_prefix_share`) opens with one of `shared_prefixes` common
  prefixes (a system prompt of `shared_prefix_blocks` blocks): a little reuse across
  conversations, as in the real trace;
- answers are short: log-uniform in `output_tokens`.

Records are sorted by timestamp; ids are dense integers in order of first use. One id is one
block of 512 tokens (`TRACE_BLOCK`). The first few hundred requests are mostly first turns
(later turns come minutes later), so the head of the trace has little reuse and the reuse
builds up over time, like the Mooncake trace's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TRACE_BLOCK = 512
GENERATOR_VERSION = 1  # bump when the output for the same parameters changes
CACHE_DIR = Path(__file__).resolve().parents[1] / "out" / "traces"  # bench/out, git-ignored


@dataclass(frozen=True)
class TraceParams:
    seed: int = 0
    duration_s: float = 900.0  # length of the trace: turns after it are left out
    conversation_rate: float = 1.3  # new conversations per second (Poisson)
    single_turn_share: float = 0.4
    mean_extra_turns: float = 3.0  # of a multi-turn conversation, beyond its first
    max_turns: int = 12
    think_s: tuple[float, float] = (30.0, 600.0)  # log-uniform pause between turns
    min_input: int = 500
    max_input: int = 32000
    input_alpha: float = 0.6  # bounded Pareto shape of first-turn prompts
    message_tokens: tuple[int, int] = (30, 1500)  # log-uniform user message of a later turn
    output_tokens: tuple[int, int] = (10, 400)  # log-uniform answer length
    shared_prefixes: int = 6
    shared_prefix_share: float = 0.1
    shared_prefix_blocks: tuple[int, int] = (1, 6)


def _log_uniform(r: random.Random, lo: float, hi: float) -> float:
    return math.exp(r.uniform(math.log(lo), math.log(hi)))


def bounded_pareto(r: random.Random, lo: float, hi: float, alpha: float) -> float:
    """Inverse-CDF sample of a Pareto law of shape alpha truncated to [lo, hi]."""
    u = r.random()
    ratio = (lo / hi) ** alpha
    return float(lo / (1.0 - u * (1.0 - ratio)) ** (1.0 / alpha))


def generate(p: TraceParams = TraceParams()) -> list[dict[str, Any]]:
    """The trace as Mooncake records (`timestamp` ms, `input_length`, `output_length`, `hash_ids`),
    in time order."""
    records = [(rec["timestamp"], c, k, rec) for c, conv in enumerate(conversations(p)) for k, rec in enumerate(conv)]
    records.sort(key=lambda x: x[:3])
    return [rec for *_, rec in records]


def conversations(p: TraceParams = TraceParams()) -> list[list[dict[str, Any]]]:
    """The trace's conversations, each a list of its turns' records, in order of their start."""
    r = random.Random(p.seed)
    next_id = 0

    def new_ids(k: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + k))
        next_id += k
        return ids

    shared = [new_ids(r.randint(*p.shared_prefix_blocks)) for _ in range(p.shared_prefixes)]
    out: list[list[dict[str, Any]]] = []
    t = 0.0
    while True:
        t += r.expovariate(p.conversation_rate)
        if t >= p.duration_s:
            break
        conv: list[dict[str, Any]] = []
        out.append(conv)
        turns = 1
        if r.random() >= p.single_turn_share:
            # 1 + geometric(mean mean_extra_turns) extra turns.
            q = 1.0 / (1.0 + p.mean_extra_turns)
            extra = 1
            while r.random() > q and 1 + extra < p.max_turns:
                extra += 1
            turns = 1 + extra
        prefix = shared[r.randrange(len(shared))] if shared and r.random() < p.shared_prefix_share else []
        n_in = int(bounded_pareto(r, p.min_input, p.max_input, p.input_alpha))
        n_in = max(n_in, len(prefix) * TRACE_BLOCK + 1)
        ids = list(prefix) + new_ids(-(-n_in // TRACE_BLOCK) - len(prefix))
        at = t
        for k in range(turns):
            n_out = round(_log_uniform(r, *p.output_tokens))
            conv.append({"timestamp": round(at * 1000), "input_length": n_in, "output_length": n_out, "hash_ids": ids})
            if k + 1 == turns:
                break
            grown = n_in + n_out + round(_log_uniform(r, *p.message_tokens))
            if grown > p.max_input:
                break
            whole = n_in // TRACE_BLOCK
            ids = ids[:whole] + new_ids(-(-grown // TRACE_BLOCK) - whole)
            n_in = grown
            at += _log_uniform(r, *p.think_s)
            if at >= p.duration_s:
                break
    return out


def write(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(rec, separators=(",", ":")) + "\n" for rec in records))
    tmp.replace(path)  # atomic: concurrent runs never read half a file


def cached_trace(p: TraceParams = TraceParams(), cache_dir: Path | None = None) -> Path:
    """Path of the trace for `p`, generated on first use into the cache directory (the name
    carries a digest of the parameters and the generator version, so a stale file is never read)."""
    key = json.dumps({"v": GENERATOR_VERSION, **asdict(p)}, sort_keys=True)
    digest = hashlib.blake2b(key.encode(), digest_size=6).hexdigest()
    path = (cache_dir or CACHE_DIR) / f"conversations-s{p.seed}-{digest}.jsonl"
    if not path.exists():
        write(path, generate(p))
    return path


def describe(records: list[dict[str, Any]], n: int | None = None) -> dict[str, Any]:
    """Shape of the trace (or its first n records): rate, lengths, and the infinite-cache hit
    ratio in whole 512-token blocks (a block hits when an earlier prompt had the same id there)."""
    recs = records[:n] if n else records
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for rec in recs:
        ids = rec["hash_ids"]
        whole = rec["input_length"] // TRACE_BLOCK
        k = 0
        while k < whole and tuple(ids[: k + 1]) in seen:
            k += 1
        hit += k * TRACE_BLOCK
        total += rec["input_length"]
        seen.update(tuple(ids[: j + 1]) for j in range(whole))
    ins = sorted(rec["input_length"] for rec in recs)
    span = (recs[-1]["timestamp"] - recs[0]["timestamp"]) / 1000.0 if recs else 0.0
    return {
        "requests": len(recs),
        "span_s": span,
        "rate": len(recs) / span if span else None,
        "input_p50": ins[len(ins) // 2],
        "input_mean": sum(ins) / len(ins),
        "input_max": ins[-1],
        "output_mean": sum(rec["output_length"] for rec in recs) / len(recs),
        "block_hit_ratio": hit / total if total else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.workloads.trace_gen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the trace here (default: print the cached trace's path)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration-s", type=float, default=TraceParams.duration_s)
    ap.add_argument("--head", type=int, default=400, help="also describe the first N requests")
    a = ap.parse_args(argv)
    p = TraceParams(seed=a.seed, duration_s=a.duration_s)
    records = generate(p)
    if a.out:
        write(Path(a.out), records)
        print(a.out)
    else:
        print(cached_trace(p))
    print("all:", describe(records))
    print(f"first {a.head}:", describe(records, a.head))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
