"""Offered load in units of the simulated cluster's capacity, from the simulator's timing model.

A simulated engine runs steps back to back while it has work; a step lasts
`step_overhead_s + prefill_token_s x tokens prefilled + decode_seq_s x sequences decoding`,
divided by `speed` (engine_launcher/sim/config.py, `TimingModel`). Prefill and decode costs
add up request by request; the step overhead is paid per step, and a saturated engine fills
every step with a prefill chunk of up to `max_num_batched_tokens` (decodes ride along), so a
request is charged one overhead per chunk of its prompt. One request's work, in engine-seconds:

    w = (prefill_token_s * m + decode_seq_s * o + step_overhead_s * ceil(m / max_num_batched_tokens)) / speed

with m the prompt tokens that must be computed and o the output tokens. The utilisation of
K decode engines under a workload of n requests arriving over span_s seconds is

    rho = (sum of w over the requests) / span_s / K

(engine-seconds of work per second, per engine; K counts engines at `speed`, so a fleet whose
decoders run at shares f_i of it has K = sum of f_i). `m` is taken two ways: every prompt token
(`utilisation`: the load the workload brings when nothing is cached, a property of the
workload alone, which the suite sets rates by; a router lowers it with prefix hits) and the
prompt tokens an infinite shared cache would still compute (`utilisation_oracle`: the load
left for a perfect router). On route pd the prompt is computed on the P prefill engines
instead: `pd_prefill_utilisation` is their load if every request fell back to
prefill/decode (with no hits), `pd_prefill_utilisation_oracle` the same with the oracle's hits.

The last bounds what any placement can do for inter-token latency: P producers can compute
at most 1 / pd_prefill_utilisation_oracle of the prompt work that is left after every
possible hit, so at least `decoder_prefill_share` = 1 - 1 / that of it is computed on decode
engines (each chunk stalling the sequences decoding there) by any router whose producer
queue stays bounded. Only a queue growing for the whole run (the time to first token
growing with it) moves it all to the producers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bench.harness.cluster import SimOptions
from engine_launcher.sim.config import TimingModel


@dataclass(frozen=True)
class Load:
    requests: int
    span_s: float
    offered_rps: float
    work_s: float  # engine-seconds, nothing cached
    work_oracle_s: float  # engine-seconds, the oracle's hits removed
    utilisation: float
    utilisation_oracle: float
    pd_prefill_utilisation: float | None
    pd_prefill_utilisation_oracle: float | None = None

    @property
    def decoder_prefill_share(self) -> float | None:
        """The least share of the prompt work left after every hit that decode engines
        compute under any placement with a bounded producer queue (module docstring)."""
        u = self.pd_prefill_utilisation_oracle
        return None if u is None else max(0.0, 1.0 - 1.0 / u) if u > 0 else 0.0


def timing_of(sim: SimOptions) -> TimingModel:
    """The timing model the bench's engines run with (SimOptions overrides the per-token costs)."""
    t = TimingModel()
    return TimingModel(
        step_overhead_s=t.step_overhead_s,
        prefill_token_s=t.prefill_token_s if sim.prefill_token_s is None else sim.prefill_token_s,
        decode_seq_s=t.decode_seq_s,
        kv_transfer_token_s=t.kv_transfer_token_s if sim.kv_transfer_token_s is None else sim.kv_transfer_token_s,
    )


def request_work_s(computed_tokens: int, output_tokens: int, sim: SimOptions) -> float:
    """Engine-seconds one request costs (module docstring)."""
    t = timing_of(sim)
    chunks = max(1, math.ceil(computed_tokens / sim.max_num_batched_tokens))
    return float(
        (t.prefill_token_s * computed_tokens + t.decode_seq_s * output_tokens + t.step_overhead_s * chunks) / sim.speed
    )


def prefill_work_s(computed_tokens: int, sim: SimOptions) -> float:
    t = timing_of(sim)
    chunks = max(1, math.ceil(computed_tokens / sim.max_num_batched_tokens))
    return float((t.prefill_token_s * computed_tokens + t.step_overhead_s * chunks) / sim.speed)


def offered_load(
    prompt_tokens: Sequence[int],
    hit_tokens: Sequence[int],
    output_tokens: Sequence[int],
    span_s: float,
    sim: SimOptions,
    engines: float,
    prefill: int = 0,
) -> Load:
    """Load of n requests (prompt, oracle hit and output tokens of each) arriving over span_s."""
    n = len(prompt_tokens)
    if n == 0 or span_s <= 0 or engines <= 0:
        raise ValueError("offered load needs requests, a positive span and engines")
    work = sum(request_work_s(p, o, sim) for p, o in zip(prompt_tokens, output_tokens, strict=False))
    work_or = sum(
        request_work_s(p - h, o, sim) for p, h, o in zip(prompt_tokens, hit_tokens, output_tokens, strict=False)
    )
    pd = pd_oracle = None
    if prefill > 0:
        pd = sum(prefill_work_s(p, sim) for p in prompt_tokens) / span_s / prefill
        pd_oracle = (
            sum(prefill_work_s(p - h, sim) for p, h in zip(prompt_tokens, hit_tokens, strict=False)) / span_s / prefill
        )
    return Load(
        requests=n,
        span_s=span_s,
        offered_rps=n / span_s,
        work_s=work,
        work_oracle_s=work_or,
        utilisation=work / span_s / engines,
        utilisation_oracle=work_or / span_s / engines,
        pd_prefill_utilisation=pd,
        pd_prefill_utilisation_oracle=pd_oracle,
    )


def span_for_utilisation(work_s: float, engines: int, target: float) -> float:
    """The arrival span that puts `work_s` engine-seconds on K engines at utilisation `target`."""
    if target <= 0:
        raise ValueError("target utilisation must be > 0")
    return work_s / (engines * target)


def rate_for_utilisation(mean_work_s: float, engines: int, target: float) -> float:
    """Poisson rate (requests/s) that puts K engines at utilisation `target`."""
    if mean_work_s <= 0:
        raise ValueError("mean work must be > 0")
    return target * engines / mean_work_s
