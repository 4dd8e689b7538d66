"""Where a prompt is computed, judged by goodput: requests within both SLOs, new and running.

DistServe's goodput counts the requests that meet both a time-to-first-token SLO and an
inter-token-latency SLO. A placement of a prompt nobody holds (router/routing/fallback.py)
affects more than its own request: computed on a decoder, its prefill makes the next
steps there longer for every sequence decoding on it (`costmodel.prefill_stall_s`); split
over a producer and a consumer, the consumer's sequences only see one more sequence
joining, but the request waits for the producer's queue and the KV transfer.

Each candidate placement is predicted with the one cost model (router/routing/costmodel.py):

- the request's own TTFT (`ttft` or `pd_ttft`) and ITL (`itl` on its decoder);
- per engine it touches, the running sequences it pushes past the ITL SLO: those whose
  next steps were within it and with this prompt's prefill chunk (on a decoder computing
  it) or one more sequence (on the consumer) no longer are, less those a stalling prefill
  already pushed past it (`BackendView.stalled`, counted by router/fleet/legs.py);
- on a decoder computing it, the splits placed there whose KV is still on its way and
  that this prefill makes late: their decode legs arrive behind it (`pushed_past_ttft`).

The candidate that loses the fewest requests (the new one counts one if it misses either
SLO, each pushed running sequence one) wins; ties go to the least predicted TTFT, except
that a direct placement winning a tie yields to a split through an idle producer that
delays the fleet less (`on_idle_producer`: the sequences beside a prefill each wait its
whole time, within the SLO or not). The
count is of this moment only, so a split predicted past the request's own SLO is no
candidate (`worth_splitting`): its loss is certain and its prefill lengthens the
producer's queue that every later split waits in (unless producers are idle to spare while
they could prefill every prompt: `spare_producers`). Traded for running sequences, each
split makes the next request face the same trade on a longer queue until every split
misses (measured: a producer's queue grew to 35 s); kept within the SLO, the producer
takes what it can serve in time, and the decoders the rest. (Placing a request that
misses wherever it goes where it is least late, instead, gave up the splits that kept
the decoders' sequences within the ITL SLO: goodput fell from 0.125 to 0.025 on the
real-arrivals workload.) Goodput loses a sequence at its first gap over the ITL SLO, so
a sequence that already sat beside a stalling prefill costs nothing more: a prompt that
must stall a decoder goes where decoders stall already, and the others keep their
sequences within the SLO. (Counting every decoding sequence, such prompts went wherever
sequences had just finished, every decoder in turn, and every decoder's sequences were
stalled.) A request that misses wherever it goes lands on the engine where it loses the
fewest others: a sacrifice that keeps the other engines free for requests that can still
make their SLO, and leaves the hopeless ones late (an operator may bound how late:
`Slo.ttft_stretch`, `best`). Holding such requests in the router
and placing them as engines freed (late binding) brought probe's TTFT p99 down to round
robin's and its goodput down to round robin's too (0.26-0.30 -> 0.03 on the loaded
workloads: each released prefill took the engine the next on-time request needed).
Nothing here does I/O:
plain views in, a choice out.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.readonly import readonly
from router.routing import costmodel
from router.routing.planning import predicted_ttft
from router.routing.snapshot import BackendView


@readonly
class Slo:
    """The two SLOs of goodput, in seconds, the fleet's prefill chunk (vLLM's
    max_num_batched_tokens; an engine's own is its view's `chunk_tokens`), and how much later
    than its soonest start a request that misses anyway may be placed (`best`; 0: no bound)."""

    ttft_s: float = 2.0
    itl_s: float = 0.1
    chunk_tokens: float = 8192.0
    ttft_stretch: float = 0.0


@readonly
class Placement:
    """One way to compute a prompt and what the cost model predicts of it."""

    decode: str
    prefill: str | None  # the producer of a split; None: computed on the decoder
    ttft_s: float  # the request's predicted time to first token
    itl_s: float  # the request's predicted gap between tokens
    stalled: float  # running sequences it pushes past the ITL SLO
    lacking: float = 0.0  # what the computing engine prefills
    # What its prefill adds to the waits of the sequences decoding beside it, summed over
    # them (a direct placement's; a prefill-only producer runs no sequences).
    delay_s: float = 0.0

    def misses(self, slo: Slo) -> bool:
        """The request itself is predicted past its TTFT or ITL SLO."""
        return self.ttft_s > slo.ttft_s or self.itl_s > slo.itl_s

    def lost(self, slo: Slo) -> float:
        """Requests this placement is predicted to lose: itself if it misses either SLO,
        plus the running sequences it pushes past the ITL SLO."""
        return float(self.misses(slo)) + self.stalled

    @property
    def reason(self) -> str:
        return "split" if self.prefill else "direct"


def pushed_past_itl(view: BackendView, extra_step_s: float, joining: float, slo: Slo) -> float:
    """Sequences decoding on `view` whose steps are within the ITL SLO now and would not be
    with `extra_step_s` more per step and `joining` more sequences; those a stalling
    prefill already pushed past it (`BackendView.stalled`) are lost already. An engine that
    serves no decode legs (a prefill-only producer) has none: what runs there is other
    prompts' prefills, one token each, whatever its scraped counts say."""
    if not view.decodes or view.decoding <= 0 or step_past_itl(view.itl, view.decoding, 0.0, slo):
        return 0.0
    if not step_past_itl(view.itl, view.decoding + joining, extra_step_s, slo):
        return 0.0
    return max(view.decoding - view.stalled, 0.0)


def step_past_itl(step: costmodel.ItlSpeed, decoding: float, extra_step_s: float, slo: Slo) -> bool:
    """Is an engine step with `decoding` sequences and `extra_step_s` more longer than the ITL SLO?"""
    return step.seconds(decoding) + extra_step_s > slo.itl_s


def prefill_stalls(
    speed: costmodel.EngineSpeed, step: costmodel.ItlSpeed, decoding: float, tokens: float, slo: Slo, chunk: float
) -> bool:
    """Does a leg prefilling `tokens` on an engine with `decoding` sequences and a prefill
    chunk of `chunk` tokens make its steps longer than the ITL SLO (the test
    `pushed_past_itl` applies to a direct placement)?"""
    return tokens > 0 and step_past_itl(step, decoding + 1.0, costmodel.prefill_stall_s(speed, tokens, chunk), slo)


def direct(view: BackendView, lacking: float, ttft_s: float, slo: Slo) -> Placement:
    """Computed and decoded on `view`, which lacks `lacking` of the prompt."""
    stall = costmodel.prefill_stall_s(view.speed, lacking, view.chunk_tokens)
    return Placement(
        decode=view.name,
        prefill=None,
        ttft_s=ttft_s,
        itl_s=costmodel.itl(view.itl, view.decoding),
        stalled=pushed_past_itl(view, stall, 1.0, slo) + pushed_past_ttft(view, ttft_s),
        lacking=lacking,
        delay_s=max(view.decoding, 0.0) * costmodel.prefill_delay_s(view.speed, lacking),
    )


def pushed_past_ttft(view: BackendView, ttft_s: float) -> float:
    """Splits decoding on `view`, their KV on its way, that a prefill there finishing in
    `ttft_s` pushes past their TTFT SLO: their decode legs arrive behind it. Those the queue
    already there makes late are lost anyway."""
    if not view.kv_awaited_s:
        return 0.0
    queue_s = predicted_ttft(view, 0.0)
    return float(sum(1 for left in view.kv_awaited_s if queue_s <= left < ttft_s))


def split(producer: BackendView, consumer: BackendView, prompt: float, ttft_s: float, slo: Slo) -> Placement:
    """Prefilled on `producer`, KV over NIXL, decoded on `consumer`."""
    stall = costmodel.prefill_stall_s(producer.speed, prompt, producer.chunk_tokens)
    return Placement(
        decode=consumer.name,
        prefill=producer.name,
        ttft_s=ttft_s,
        itl_s=costmodel.itl(consumer.itl, consumer.decoding),
        stalled=pushed_past_itl(producer, stall, 0.0, slo) + pushed_past_itl(consumer, 0.0, 1.0, slo),
        lacking=prompt,
    )


def on_idle_producer(
    chosen: Placement, splits: Sequence[Placement], idle_producers: frozenset[str], slo: Slo
) -> Placement | None:
    """A split through an idle producer that delays the fleet less than `chosen`, a direct
    placement goodput's count ties it with: its own TTFT later by less than the time the
    direct prefill would add to the waits of the sequences decoding beside it, summed
    (`Placement.delay_s`), and no request more lost. A stall within the ITL SLO loses
    nobody, so the count alone sends every cold prompt to a decoder, whose sequences then
    each wait that prefill's time; an idle producer's time is free now (nothing queued,
    no prefill of ours in flight), so the prompt goes there. Producers with a queue are
    left to goodput's count: there the split's prefill would add to a wait that later
    splits inherit, which the count of this moment cannot weigh."""
    if chosen.prefill is not None or chosen.delay_s <= 0.0:
        return None
    fits = [
        p
        for p in splits
        if p.prefill in idle_producers
        and not p.misses(slo)
        and p.lost(slo) <= chosen.lost(slo)
        and p.ttft_s - chosen.ttft_s < chosen.delay_s
    ]
    return min(fits, key=lambda p: p.ttft_s) if fits else None


def worth_splitting(split: Placement, slo: Slo, spare: frozenset[str] = frozenset()) -> bool:
    """A split is a candidate while it meets the request's own SLOs (module docstring), or
    when its producer is one of the `spare` ones (`spare_producers`): a prefill nobody waits
    behind costs no later split its time."""
    return not split.misses(slo) or split.prefill in spare


def idle(view: BackendView) -> bool:
    """Nothing waits on the engine's queue and no prefill of ours is in flight there."""
    return view.queued_tokens <= 0.0 and view.prefilling == 0


def spare_producers(producers: Sequence[BackendView], prompt_tokens_per_s: float | None = None) -> frozenset[str]:
    """The producers a split predicted to miss its own SLO may take: the idle prefill-only
    ones, when at least two are idle. Such a request is lost wherever it goes; on a decoder
    it stalls the sequences there (or, the triage's sacrifice, joins the queue of one whose
    sequences are stalled already and waits there for seconds), while on an idle producer
    it stalls nobody and waits for nothing. What keeps it from the producer time the triage
    protects (module docstring) is the second idle producer, free for the next request that
    can still make its SLO. A decoder that also prefills (role `both`) is never to spare:
    the sequences sent there while it computes a late prompt would be stalled by it.

    With `prompt_tokens_per_s` (routing.spare_producers = "auto"), only while the producers
    could prefill that much prompt work by themselves (`prefill_capacity`): where they could
    not, on-time prompts arrive behind a late one faster than one idle producer serves them,
    and holding producers for late ones cost 0.03-0.09 of goodput with two producers
    (bench/RESULTS.md, "Producers to spare")."""
    names = idle_producers(producers)
    if len(names) < 2:
        return frozenset()
    own = [p for p in producers if not p.decodes]
    if prompt_tokens_per_s is not None and prompt_tokens_per_s >= prefill_capacity(own):
        return frozenset()
    return names


def idle_producers(producers: Sequence[BackendView]) -> frozenset[str]:
    """The prefill-only producers with nothing queued and no prefill of ours in flight (a
    decoder that also prefills runs sequences a prefill there would stall)."""
    return frozenset(p.name for p in producers if not p.decodes and idle(p))


def prefill_capacity(producers: Sequence[BackendView]) -> float:
    """Prompt tokens per second the producers prefill together at their measured speeds; one
    not measured yet counts nothing (its speed is the configured prior, a guess that must
    not give producer time away)."""
    return sum(1.0 / max(p.speed.per_token_s, costmodel.MIN_PER_TOKEN_S) for p in producers if p.speed.samples)


def best(candidates: Sequence[Placement], slo: Slo) -> Placement:
    """The placement that loses the fewest requests; ties: the least predicted TTFT (then
    the first, so callers order candidates by preference).

    With `slo.ttft_stretch` (routing.max_ttft_stretch), only among the placements
    predicted within that many times the soonest predicted TTFT (or within the TTFT SLO):
    a request that misses wherever it goes then loses the fewest others without waiting
    many times longer than it needs to. Unbounded, that triage feeds one engine every such
    request while the others keep their sequences within the ITL SLO, and its queue grows
    to tens of seconds; bounded at 2, the tail fell below round robin's and goodput to
    round robin's (bench/RESULTS.md, "A bound on the triage")."""
    if slo.ttft_stretch > 0.0 and len(candidates) > 1:
        bound = max(slo.ttft_s, slo.ttft_stretch * min(p.ttft_s for p in candidates))
        candidates = [p for p in candidates if p.ttft_s <= bound]  # the soonest always is
    return min(candidates, key=lambda p: (p.lost(slo), p.ttft_s))
