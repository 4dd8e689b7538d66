"""Where a prompt that no engine accepted is computed: one decoder, or prefill/decode.

A pure function of (query, snapshot, routing, the prompt's length, what each engine holds)
over the one cost model (router/routing/costmodel.py):

- computed on decoder d: ttft(d, prompt - hit_d, hit_d), where hit_d is what d's rejection
  reported, counting both its GPU prefix cache and its CPU tier (or, larger, what the
  strategy expects it to hold: a prompt the router just sent there and the engine is still
  computing); held tokens cost what d's CPU-tier loads cost (router/routing/costmodel.py);
- split: prefill on producer p, KV over NIXL, decode on consumer c:
  pd_ttft = max(ttft(p, prompt) + transfer(prompt), ttft(c, 0)).

The least predicted time wins. A split is considered only when a prefill backend other
than the decoder exists and the decoder would lack at least `min_pd_prompt_tokens` (an
operator's floor: below it a KV transfer is never worth its moving parts). With
`routing.split = "always"` such a split is always taken (the fastest pair), to keep
prefills off the decoders.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from router.config.schema import RoutingConfig
from router.names import Mode, Route
from router.routing import costmodel
from router.routing.planning import RouteQuery, decoders_for, fastest
from router.routing.snapshot import ClusterSnapshot


@dataclass(frozen=True, slots=True)
class FallbackPlan:
    """After every probe rejected: prefill on `prefill` then decode on `decode`, or
    (prefill None) run directly on `decode`, sending `decode_threshold`."""

    decode: str
    prefill: str | None
    decode_threshold: float
    prefill_tokens: int = 0  # what the computing engine (producer, or the decoder) prefills
    predicted_ttft_s: float | None = None

    @property
    def route(self) -> str:
        return Route.PD if self.prefill else Route.DIRECT


def plan_fallback(
    query: RouteQuery,
    snap: ClusterSnapshot,
    routing: RoutingConfig,
    prompt_tokens: float | None,
    exclude: frozenset[str] = frozenset(),
    hits: Mapping[str, float] | None = None,
) -> FallbackPlan | None:
    """See the module docstring. `prompt_tokens` None: estimated from the query."""
    decoders = decoders_for(query, snap, exclude)
    if not decoders:
        return None
    hits = hits or {}
    n = query.tokens(snap) if prompt_tokens is None else float(prompt_tokens)
    decode, direct_s = fastest(decoders, lambda b: n - hits.get(b.name, 0.0), query.salt, n)
    lacking = max(n - hits.get(decode.name, 0.0), 0.0)
    best = FallbackPlan(
        decode=decode.name, prefill=None, decode_threshold=0.0, prefill_tokens=round(lacking), predicted_ttft_s=direct_s
    )
    producers = [b for b in snap.prefillers(query.model) if b.name not in exclude]
    if not producers or n < routing.min_pd_prompt_tokens:
        return best
    # split "always": any split beats computing on a decoder.
    best_key = (float("inf") if routing.split == Mode.ALWAYS else direct_s, 0.0)
    for p in producers:
        # Ties (the consumer's queue decides) go to the producer that finishes sooner.
        prefill_s = costmodel.ttft(p.speed, p.queued_tokens, p.decoding, n)
        for c in decoders:
            if c.name == p.name or n - hits.get(c.name, 0.0) < routing.min_pd_prompt_tokens:
                continue
            s = costmodel.pd_ttft(
                p.speed, p.queued_tokens, p.decoding, n, c.speed, c.queued_tokens, c.decoding, snap.transfer, n
            )
            if (s, prefill_s) < best_key:
                best_key = (s, prefill_s)
                best = FallbackPlan(
                    decode=c.name,
                    prefill=p.name,
                    decode_threshold=routing.decode_guard_threshold,
                    prefill_tokens=round(n),
                    predicted_ttft_s=s,
                )
    return best
