"""The one cost model: predicted time to first token (TTFT) of a request on an engine.

Every load- or cache-aware routing decision reads `ttft` or `pd_ttft`, so any choice can
be explained from one formula. A vLLM engine schedules in steps: running requests first,
then waiting ones in arrival order, up to a token budget per step; a step costs a fixed
overhead, a cost per prefilled token and a cost per decoding sequence. So the first token
of a request sent now arrives once the engine has prefilled what is queued ahead of it
plus what it lacks of this prompt, while its decoding sequences slow every step:

    ttft(engine, lacking, held) = a + b * (queued_tokens + lacking) + h * held + c * decoding

- `queued_tokens`: prompt tokens still to prefill ahead of the request: what this router
  sent there and has not seen a first token for, less what the engine has prefilled of it
  at its measured speed since it began on the oldest (router/fleet/legs.py
  `queued_ahead`), plus, for traffic it did not send (other replicas), the engine's
  scraped waiting requests beyond its own, each at the mean prompt length, less what the
  engine has prefilled since the scrape (`BackendView.queued_tokens`);
- `lacking`: prompt tokens of this request the engine does not hold (a rejection's
  `cached_tokens`, the prefix memory of where prompts went, else the whole prompt);
- `held`: the prompt tokens it does hold. A hit in the GPU prefix cache is free, but an
  engine with a CPU tier (vLLM's OffloadingConnector) loads part of its hits from host
  memory first: each held token costs `h`, the engine's measured load time per CPU-hit
  token times the share of its hits that come from the CPU tier (0 without a tier), never
  more than recomputing it (`b`);
- `decoding`: sequences generating on the engine (its own streams past their first
  token, or the scraped running count if larger);
- a, b, c: the engine's measured speed (`EngineSpeed`), learned online per engine from
  observed legs (router/routing/speed_learner.py), starting at a prior; h from the engine's own
  offload counters, scraped.

Prefill on a producer, KV over NIXL, decode on a consumer runs the producer's prefill in
parallel with the consumer's own queue:

    pd_ttft = max(ttft(producer, lacking_p) + transfer(prompt), ttft(consumer, 0))

with transfer(n) = t0 + t1 * n learned from observed decode legs (`TransferSpeed`).

The same steps give the inter-token latency (ITL) of the sequences decoding on an engine:
each step produces one token of each, and costs

    step(engine, decoding, prefill_in_step) = e + s * decoding + b * prefill_in_step

- e, s: the engine's measured decode step (`ItlSpeed`), learned from finished legs' mean
  gap between tokens, less the prefills the engine computed meanwhile (b * those tokens
  over the leg's tokens: the stall they caused is b's to explain);
- b: the same per-token prefill cost as in `ttft`. A prefill of n tokens computed on a
  decoder is chunked into steps of at most `chunk` tokens (vLLM's max_num_batched_tokens),
  so each of its ceil(n / chunk) steps costs b * min(n, chunk) more for every sequence
  decoding there (`prefill_stall_s`). That is the cost a TTFT-only objective cannot see,
  and why prefill/decode exists: a split's prefill stalls nobody on the consumer.

A request's own ITL is step(its decoder, decoding + 1, 0) (`itl`).

Nothing here does I/O or keeps state: plain numbers in, seconds out.
"""

from __future__ import annotations

from router.readonly import readonly

# Slopes never go below these in a prediction: a model fitted on a noisy stretch must not
# claim that queued work is free.
MIN_PER_TOKEN_S = 1e-7
MIN_INTERCEPT_S = 0.0


@readonly
class EngineSpeed:
    """ttft = intercept_s + per_token_s * prefill tokens ahead + per_decode_s * decoding."""

    intercept_s: float = 0.02
    per_token_s: float = 1e-4  # 10k prompt tokens/s: a prior, replaced by measurements
    per_decode_s: float = 1e-4
    samples: int = 0
    # Mean cost of a prompt token the engine holds: 0 for GPU hits, more with a CPU tier.
    held_per_token_s: float = 0.0

    def ttft(self, prefill_tokens: float, decoding: float, held: float = 0.0) -> float:
        per_token = max(self.per_token_s, MIN_PER_TOKEN_S)
        return (
            max(self.intercept_s, MIN_INTERCEPT_S)
            + per_token * prefill_tokens
            + max(self.per_decode_s, 0.0) * decoding
            + self.held_cost_s(held)
        )

    def held_cost_s(self, held: float) -> float:
        """Seconds to make `held` cached prompt tokens usable (CPU-tier loads): more than a
        GPU hit's nothing, never more than recomputing them."""
        per_held = min(max(self.held_per_token_s, 0.0), max(self.per_token_s, MIN_PER_TOKEN_S))
        return per_held * max(held, 0.0)


@readonly
class TransferSpeed:
    """Extra time of a decode leg that pulls `n` prompt tokens of KV: t0 + t1 * n."""

    intercept_s: float = 0.01
    per_token_s: float = 1e-5
    samples: int = 0

    def seconds(self, tokens: float) -> float:
        return max(self.intercept_s, 0.0) + max(self.per_token_s, 0.0) * tokens


@readonly
class ItlSpeed:
    """One decode step: step_s + per_seq_s * decoding sequences (each gets one token)."""

    step_s: float = 0.01
    per_seq_s: float = 1e-4
    samples: int = 0

    def seconds(self, decoding: float) -> float:
        return max(self.step_s, 0.0) + max(self.per_seq_s, 0.0) * max(decoding, 0.0)


def itl(step: ItlSpeed, decoding: float) -> float:
    """Predicted gap between tokens of a request joining `decoding` sequences on an engine."""
    return step.seconds(decoding + 1.0)


def prefill_stall_s(speed: EngineSpeed, tokens: float, chunk: float) -> float:
    """What computing `tokens` of prefill adds to each of the engine's next steps (every
    sequence decoding there waits that long more for its next token), chunked prefill
    spreading it over steps of at most `chunk` tokens."""
    return prefill_delay_s(speed, min(tokens, max(chunk, 1.0)))


def prefill_delay_s(speed: EngineSpeed, tokens: float) -> float:
    """What computing `tokens` of prefill adds, over all its steps, to the time each
    sequence decoding on the engine waits for its tokens (`prefill_stall_s` per step)."""
    return max(speed.per_token_s, MIN_PER_TOKEN_S) * max(tokens, 0.0)


def ttft(speed: EngineSpeed, queued_tokens: float, decoding: float, lacking: float, held: float = 0.0) -> float:
    """Predicted seconds to the first token of a request whose engine lacks `lacking`
    prompt tokens and holds `held`, with `queued_tokens` of prefill ahead and `decoding`
    sequences."""
    return speed.ttft(queued_tokens + max(lacking, 0.0), decoding, held)


def pd_ttft(
    producer: EngineSpeed,
    producer_queued: float,
    producer_decoding: float,
    producer_lacking: float,
    consumer: EngineSpeed,
    consumer_queued: float,
    consumer_decoding: float,
    transfer: TransferSpeed,
    prompt_tokens: float,
) -> float:
    """Predicted seconds to the first token through prefill/decode: the producer prefills
    while the consumer works through its own queue; the decode starts when both are done."""
    prefill = ttft(producer, producer_queued, producer_decoding, producer_lacking)
    consumer_ready = ttft(consumer, consumer_queued, consumer_decoding, 0.0)
    return max(prefill + transfer.seconds(prompt_tokens), consumer_ready)


def hit_saving_s(speed: EngineSpeed, prompt_tokens: float) -> float:
    """The most a cache hit can save on this engine: prefilling the whole prompt."""
    return max(speed.per_token_s, MIN_PER_TOKEN_S) * prompt_tokens
