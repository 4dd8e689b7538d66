"""Workloads for the benchmarks: deterministic prompt text, arrival times, and the oracle.

Every prompt is made of words of the simulator's vocabulary, each with a leading space
(`" word"` is one token of `engine_launcher.sim.tokenizer`), so a synthetic block of N
words is exactly N simulator tokens and equal ids give equal text, hence equal token ids
and equal KV blocks in every engine.

Four workloads, all producing a list of `BenchRequest` in arrival order:

- `mooncake_trace`: the Mooncake trace format (JSONL `timestamp` ms, `input_length`,
  `output_length`, `hash_ids`: one id per 512-token block). Each hash id becomes a block of
  `block_tokens` words (the length scale is block_tokens / 512); the last block of a prompt
  is cut to its scaled share, so it is still a prefix of that id's full text.
- `prefix_groups`: G groups that each share a system prompt; each request is its group's
  system prompt plus a question of its own; Poisson arrivals, groups interleaved.
- `heterogeneous`: unrelated prompts of log-uniform lengths (e.g. 32 to 8,000 tokens).
- `multiturn`: chat sessions whose turn k+1 prompt is turn k's prompt + the answer the
  engine gave + a new user message (built at run time by the load generator; see
  `loadgen.run_sessions`); session starts are Poisson.

Arrivals are Poisson (`poisson_arrivals`) or bursts (`on_off_arrivals`) at a given mean rate.

`oracle_hit_tokens` computes the infinite-cache upper bound in the engines' own units
(whole KV blocks of `block_size` tokens, at most num_tokens - 1 per prompt, exactly as
vLLM's and the simulator's prefix cache count a hit).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from engine_launcher.sim import tokenizer as simtok

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake trace
VOCAB: tuple[str, ...] = simtok.WORDS
_SPACED_IDS: tuple[int, ...] = tuple(simtok.encode(" " + w)[0] for w in VOCAB)


@dataclass
class BenchRequest:
    """One request of a workload. `arrival_s` is relative to the start of the run."""

    index: int
    arrival_s: float
    prompt: str
    prompt_tokens: int
    max_tokens: int
    tag: str = ""  # group / session id, for per-group analysis
    meta: dict[str, Any] = field(default_factory=dict[str, Any])


# --- deterministic text -----------------------------------------------------------------


def _rng(*key: object) -> random.Random:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def words_text(n: int, *key: object) -> str:
    """`n` simulator tokens of text, a pure function of `key` (each word has a leading space)."""
    if n <= 0:
        return ""
    r = _rng(*key)
    return "".join(" " + VOCAB[r.randrange(len(VOCAB))] for _ in range(n))


def token_count(text: str) -> int:
    return len(simtok.encode(text))


# --- Mooncake trace ---------------------------------------------------------------------


def load_trace(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    out = []
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            out.append(orjson.loads(line))
            if limit is not None and len(out) >= limit:
                break
    return out


def mooncake_requests(
    records: Sequence[dict[str, Any]],
    *,
    block_tokens: int = 32,
    time_scale: float = 1.0,
    output_scale: float = 1.0,
    max_output: int = 0,
    seed: int = 0,
    max_prompt_tokens: int = 0,
) -> list[BenchRequest]:
    """Synthesize requests from Mooncake records; see the module docstring.

    time_scale multiplies the trace's timestamps (0.25 replays 4x faster); output_scale
    multiplies output lengths (at least 1 token), max_output caps them (0: no cap);
    max_prompt_tokens cuts prompts (0: no cap), keeping their prefix.
    """
    cache: dict[int, str] = {}

    def block(hid: int) -> str:
        t = cache.get(hid)
        if t is None:
            t = cache[hid] = words_text(block_tokens, "mooncake", seed, hid)
        return t

    out: list[BenchRequest] = []
    t0 = records[0]["timestamp"] if records else 0
    for i, r in enumerate(records):
        n = max(1, round(r["input_length"] * block_tokens / TRACE_BLOCK))
        if max_prompt_tokens:
            n = min(n, max_prompt_tokens)
        parts: list[str] = []
        left = n
        for hid in r["hash_ids"]:
            if left <= 0:
                break
            take = min(block_tokens, left)
            text = block(hid)
            # Each word is " xxx": cutting after `take` words keeps a prefix of the block.
            parts.append(text if take == block_tokens else _first_words(text, take))
            left -= take
        if left > 0:  # input_length beyond the listed blocks: unique filler
            parts.append(words_text(left, "mooncake-tail", seed, i))
        prompt = "".join(parts)
        out_len = max(1, round(r["output_length"] * output_scale))
        if max_output:
            out_len = min(out_len, max_output)
        out.append(
            BenchRequest(
                index=i,
                arrival_s=(r["timestamp"] - t0) / 1000.0 * time_scale,
                prompt=prompt,
                prompt_tokens=n,
                max_tokens=out_len,
                meta={"hash_ids": len(r["hash_ids"])},
            )
        )
    return out


def _first_words(text: str, k: int) -> str:
    # text is " w1 w2 w3 ..."; the (k+1)-th space starts word k+1.
    pos = -1
    for _ in range(k + 1):
        pos = text.find(" ", pos + 1)
        if pos < 0:
            return text
    return text[:pos]


# --- arrivals ---------------------------------------------------------------------------


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """n arrival times (s) of a Poisson process of `rate` per second; rate <= 0: all at 0."""
    if rate <= 0:
        return [0.0] * n
    r = _rng("poisson", seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += r.expovariate(rate)
    return out


def on_off_arrivals(n: int, mean_rate: float, on_s: float, off_s: float, seed: int = 0) -> list[float]:
    """n arrival times (s) in bursts: Poisson at mean_rate * (on_s + off_s) / on_s during
    on_s seconds, then off_s seconds of silence, and so on; the mean rate is mean_rate."""
    if mean_rate <= 0 or on_s <= 0 or off_s < 0:
        raise ValueError("on/off arrivals need mean_rate > 0, on_s > 0 and off_s >= 0")
    peak = mean_rate * (on_s + off_s) / on_s
    out = []
    for t in poisson_arrivals(n, peak, seed):  # t: time spent "on"
        cycle = math.floor(t / on_s)
        out.append(cycle * (on_s + off_s) + (t - cycle * on_s))
    return out


def gamma_arrivals(n: int, mean_rate: float, cv: float, seed: int = 0) -> list[float]:
    """n arrival times (s) of a gamma renewal process: mean rate `mean_rate`, gaps with
    coefficient of variation `cv` (shape 1 / cv^2; cv 1 is Poisson). Measured LLM-service
    arrivals are burstier than Poisson (BurstGPT fits gamma gaps of shape below 1): short
    clusters of requests, then lulls, without the fixed period of on/off bursts."""
    if mean_rate <= 0 or cv <= 0:
        raise ValueError("gamma arrivals need mean_rate > 0 and cv > 0")
    shape = 1.0 / (cv * cv)
    r = _rng("gamma", seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += r.gammavariate(shape, 1.0 / (shape * mean_rate))
    return out


# --- heterogeneous prompt lengths -------------------------------------------------------


def heterogeneous_requests(
    *,
    n: int = 400,
    min_tokens: int = 32,
    max_tokens: int = 8000,
    output_tokens: int = 64,
    rate: float = 8.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """n requests of unrelated text (no shared prefixes beyond chance) whose prompt lengths are
    log-uniform on [min_tokens, max_tokens]; Poisson arrivals at `rate` per second."""
    r = _rng("hetero-lengths", seed)
    lo, hi = math.log(min_tokens), math.log(max_tokens)
    out = []
    for i, t in enumerate(poisson_arrivals(n, rate, seed)):
        k = min(max_tokens, max(min_tokens, round(math.exp(r.uniform(lo, hi)))))
        out.append(
            BenchRequest(
                index=i,
                arrival_s=t,
                prompt=words_text(k, "hetero", seed, i),
                prompt_tokens=k,
                max_tokens=output_tokens,
                tag="long" if k >= math.sqrt(min_tokens * max_tokens) else "short",
            )
        )
    return out


# --- shared-prefix groups ---------------------------------------------------------------


def prefix_group_requests(
    *,
    groups: int = 8,
    per_group: int = 32,
    system_tokens: int = 1024,
    question_tokens: int = 64,
    output_tokens: int = 64,
    rate: float = 8.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """groups x per_group requests, each a group's system prompt plus its own question,
    in a deterministic shuffled order, at Poisson arrivals of `rate` per second."""
    order = [(g, j) for g in range(groups) for j in range(per_group)]
    _rng("groups-order", seed).shuffle(order)
    times = poisson_arrivals(len(order), rate, seed)
    systems = [words_text(system_tokens, "system", seed, g) for g in range(groups)]
    out = []
    for i, ((g, j), t) in enumerate(zip(order, times, strict=False)):
        prompt = systems[g] + words_text(question_tokens, "question", seed, g, j)
        out.append(
            BenchRequest(
                index=i,
                arrival_s=t,
                prompt=prompt,
                prompt_tokens=system_tokens + question_tokens,
                max_tokens=output_tokens,
                tag=f"g{g}",
            )
        )
    return out


# --- multi-turn sessions ----------------------------------------------------------------


@dataclass
class Session:
    """A chat session: `turns` user messages; the prompt of turn k is the session's system
    prompt, then for each earlier turn its message and the engine's answer, then message k."""

    sid: int
    start_s: float
    system: str
    messages: list[str]
    max_tokens: int
    think_s: float


def multiturn_sessions(
    *,
    sessions: int = 16,
    turns: int = 6,
    system_tokens: int = 256,
    message_tokens: int = 64,
    output_tokens: int = 48,
    rate: float = 1.0,
    think_s: float = 0.5,
    seed: int = 0,
) -> list[Session]:
    starts = poisson_arrivals(sessions, rate, seed + 1)
    return [
        Session(
            sid=s,
            start_s=starts[s],
            system=words_text(system_tokens, "mt-system", seed, s),
            messages=[words_text(message_tokens, "mt-user", seed, s, k) for k in range(turns)],
            max_tokens=output_tokens,
            think_s=think_s,
        )
        for s in range(sessions)
    ]


# --- oracle -----------------------------------------------------------------------------


def block_hashes(ids: Sequence[int], block_size: int) -> list[int]:
    out, h = [], 0x5EED
    for i in range(0, len(ids) - block_size + 1, block_size):
        h = hash((h, tuple(ids[i : i + block_size])))
        out.append(h)
    return out


def oracle_hit_tokens(
    sequences: Iterable[tuple[Sequence[int], Sequence[int] | None]], block_size: int
) -> tuple[int, int, list[int]]:
    """Infinite-cache prefix hits: for each (prompt ids, ids cached after it ran or None),
    in arrival order, the longest run of whole blocks already seen, at most
    (len(prompt) - 1) // block_size blocks. Returns (hit tokens, prompt tokens, per request)."""
    seen: set[int] = set()
    hits = total = 0
    per: list[int] = []
    for prompt, after in sequences:
        n = len(prompt)
        hs = block_hashes(prompt, block_size)
        k = 0
        for h in hs[: max(0, (n - 1) // block_size)]:
            if h not in seen:
                break
            k += 1
        hit = k * block_size
        per.append(hit)
        hits += hit
        total += n
        seen.update(hs)
        if after is not None:
            seen.update(block_hashes(after, block_size))
    return hits, total, per


def oracle_for_requests(reqs: Sequence[BenchRequest], block_size: int) -> dict[str, Any]:
    hits, total, per = oracle_hit_tokens(((simtok.encode(r.prompt), None) for r in reqs), block_size)
    return {
        "oracle_hit_tokens": hits,
        "prompt_tokens": total,
        "oracle_hit_ratio": hits / total if total else 0.0,
        "per_request": per,
    }


def describe(reqs: Sequence[BenchRequest]) -> dict[str, Any]:
    if not reqs:
        return {"requests": 0}
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    return {
        "requests": len(reqs),
        "span_s": round(span, 3),
        "offered_rps": round(len(reqs) / span, 3) if span > 0 else math.inf,
        "prompt_tokens": sum(r.prompt_tokens for r in reqs),
        "mean_prompt_tokens": round(sum(r.prompt_tokens for r in reqs) / len(reqs), 1),
        "max_prompt_tokens": max(r.prompt_tokens for r in reqs),
        "total_output_tokens": sum(r.max_tokens for r in reqs),
    }
