"""Where a prompt that no engine accepted is computed: one decoder, or prefill/decode.

A pure function of (query, snapshot, routing, the prompt's length, what each engine holds)
over the one cost model (router/routing/costmodel.py):

- computed on decoder d: ttft(d, prompt - hit_d, hit_d), where hit_d is what d's rejection
  reported, counting both its GPU prefix cache and its CPU tier (or, larger, what the
  strategy expects it to hold: a prompt the router just sent there and the engine is still
  computing); held tokens cost what d's CPU-tier loads cost (router/routing/costmodel.py);
- split: prefill on producer p, KV over NIXL, decode on consumer c:
  pd_ttft = max(ttft(p, prompt - hit_p) + transfer(prompt), ttft(c, 0)), where hit_p is
  what the strategy expects p to hold (a split of a prompt sharing this one's prefix, its
  prefill in flight: the prefix memory records the producer (router/dispatch/placement.py)
  until the decode leg has the KV). Consumers tie whenever the producer is the slower side:
  the least busy first (the legs already on their way counted).

With `routing.split = "auto"` the choice is goodput's (router/routing/goodput.py): the
placement predicted to keep the most requests, this one and those decoding on the engines
it touches, within both SLOs (`routing.slo_ttft_ms`, `routing.slo_itl_ms`); ties go to the
least predicted TTFT, or to a split through an idle producer that delays the direct
placement's running sequences less than it delays its own first token
(`goodput.on_idle_producer`); a split predicted to miss the request's own SLO is weighed only on a
producer to spare (`goodput.spare_producers`, with `routing.spare_producers`). A split is
considered only when a prefill backend other than the decoder exists and the decoder
would lack at least `min_pd_prompt_tokens` (an operator's floor: below it a KV transfer is
never worth its moving parts). `routing.split = "always"` takes the split whenever there
is one (the fastest pair), `"never"` never splits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from router.config.schema import RoutingConfig
from router.names import Route, RouteReason, SplitMode
from router.readonly import readonly
from router.routing import costmodel, goodput
from router.routing.planning import RouteQuery, decoders_for, fastest, predicted_ttft
from router.routing.snapshot import BackendView, ClusterSnapshot


@readonly
class FallbackPlan:
    """After every probe rejected: prefill on `prefill` then decode on `decode`, or
    (prefill None) run directly on `decode`, sending `decode_threshold`."""

    decode: str
    prefill: str | None
    decode_threshold: float
    prefill_tokens: int = 0  # what the computing engine (producer, or the decoder) prefills
    predicted_ttft_s: float | None = None
    # Why here (a RouteReason) and the predicted figures that decided it, for the log line.
    reason: str = ""
    predicted_itl_s: float | None = None
    lost: float | None = None  # requests predicted to miss an SLO (this one and running ones)
    alternative: str = ""  # the best placement of the other kind, with its figures

    @property
    def route(self) -> str:
        return Route.PD if self.prefill else Route.DIRECT

    def computed_on_decoder(self) -> FallbackPlan:
        """The split's decoder computes the prompt itself (the producer's cache is not there)."""
        return replace(self, prefill=None, decode_threshold=0.0)


def slo_of(routing: RoutingConfig) -> goodput.Slo:
    return goodput.Slo(
        routing.slo_ttft_ms / 1000.0,
        routing.slo_itl_ms / 1000.0,
        float(routing.prefill_chunk_tokens),
        routing.max_ttft_stretch,
    )


def consumer_load(c: BackendView) -> tuple[float, float]:
    """A consumer's order among a split's: when its queue is through, then the legs on it."""
    return predicted_ttft(c, 0.0), c.prefilling + c.decoding


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
    slo = slo_of(routing)
    n = query.tokens(snap) if prompt_tokens is None else float(prompt_tokens)
    directs = [
        goodput.direct(b, max(n - hits.get(b.name, 0.0), 0.0), predicted_ttft(b, n - hits.get(b.name, 0.0), n), slo)
        for b in decoders
    ]
    # The least TTFT among the decoders, with fastest()'s tie-breaking, first: goodput's
    # ties keep it.
    first, _ = fastest(decoders, lambda b: n - hits.get(b.name, 0.0), query.salt, n)
    directs.sort(key=lambda p: p.decode != first.name)
    producers = [b for b in snap.prefillers(query.model) if b.name not in exclude]
    splits: list[goodput.Placement] = []
    if producers and n >= routing.min_pd_prompt_tokens and routing.split != SplitMode.NEVER:
        # A producer computing this prompt (a split of a request sharing its prefix, still
        # in flight) holds it by the time this one's prefill runs behind it.
        def lack(p: BackendView) -> float:
            return max(n - hits.get(p.name, 0.0), 0.0)

        for p in sorted(producers, key=lambda p: costmodel.ttft(p.speed, p.queued_tokens, p.decoding, lack(p))):
            # The consumers least busy first: while the producer is the slower side, the
            # predicted TTFT is the same on every consumer and the tie keeps the first.
            for c in sorted(decoders, key=consumer_load):
                if c.name == p.name or n - hits.get(c.name, 0.0) < routing.min_pd_prompt_tokens:
                    continue
                s = costmodel.pd_ttft(
                    p.speed,
                    p.queued_tokens,
                    p.decoding,
                    lack(p),
                    c.speed,
                    c.queued_tokens,
                    c.decoding,
                    snap.transfer,
                    n,
                )
                splits.append(goodput.split(p, c, lack(p), s, slo))
    if not splits:
        reason = (
            RouteReason.SPLIT_NEVER
            if routing.split == SplitMode.NEVER
            else RouteReason.NO_PRODUCER
            if not producers
            else RouteReason.BELOW_SPLIT_FLOOR
        )
        return _plan(goodput.best(directs, slo), routing, slo, reason, None)
    best_split = min(splits, key=lambda p: p.ttft_s)  # stable: the producer finishing sooner first
    if routing.split == SplitMode.ALWAYS:
        return _plan(best_split, routing, slo, RouteReason.SPLIT_ALWAYS, goodput.best(directs, slo))
    spare = (
        frozenset()
        if routing.spare_producers == SplitMode.NEVER
        else goodput.spare_producers(
            producers, None if routing.spare_producers == SplitMode.ALWAYS else snap.prompt_tokens_per_s
        )
    )
    chosen = goodput.best([*directs, *(p for p in splits if goodput.worth_splitting(p, slo, spare))], slo)
    freer = goodput.on_idle_producer(chosen, splits, goodput.idle_producers(producers), slo)
    if freer is not None:
        return _plan(freer, routing, slo, RouteReason.IDLE_PRODUCER, chosen)
    if chosen.prefill is None:
        return _plan(chosen, routing, slo, RouteReason.GOODPUT_DIRECT, goodput.best(splits, slo))
    reason = RouteReason.SPARE_PRODUCER if chosen.misses(slo) else RouteReason.GOODPUT_SPLIT
    return _plan(chosen, routing, slo, reason, goodput.best(directs, slo))


def _plan(
    chosen: goodput.Placement, routing: RoutingConfig, slo: goodput.Slo, reason: str, other: goodput.Placement | None
) -> FallbackPlan:
    return FallbackPlan(
        decode=chosen.decode,
        prefill=chosen.prefill,
        decode_threshold=routing.decode_guard_threshold if chosen.prefill else 0.0,
        prefill_tokens=round(chosen.lacking),
        predicted_ttft_s=chosen.ttft_s,
        reason=reason,
        predicted_itl_s=chosen.itl_s,
        lost=chosen.lost(slo),
        alternative="" if other is None else describe(other, slo),
    )


def describe(p: goodput.Placement, slo: goodput.Slo) -> str:
    """One placement's figures for the log line: where, TTFT, ITL, requests lost."""
    where = f"{p.prefill}>{p.decode}" if p.prefill else p.decode
    return f"{p.reason} {where} ttft={p.ttft_s * 1000:.0f}ms itl={p.itl_s * 1000:.1f}ms lost={p.lost(slo):g}"
