"""One leg's place in its engine's load (`LegTicket`): what the registry
(router/fleet/registry.py) counts from `open_leg` to `close_leg`, the cost model's
inputs when the leg was sent, the speed samples a leg makes, and per engine what its legs
mean for goodput (`EngineLegs`): decoding legs a stalling prefill already pushed past the
ITL SLO, splits whose KV is on its way."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from router.routing.costmodel import MIN_PER_TOKEN_S, EngineSpeed
from router.routing.goodput import Slo, prefill_stalls
from router.routing.speed_learner import OWN_FIT_SAMPLES, SpeedLearner

# Legs remembered per engine, (order sent, clock, prompt tokens), for the prompts sent
# behind a leg that may have shared its last prefill step (`EngineLegs.sent_behind`).
RECENT_SENDS = 256


@dataclass(slots=True)
class LegTicket:
    """One leg's place in its engine's load, from `open_leg` to `close_leg`.

    `queued_ahead` and `decoding` are the cost model's inputs when the leg was sent; a leg
    sent with nothing queued ahead (`nothing_ahead`) makes, with the tokens it lacked and
    its time to first token, one speed sample."""

    backend: str
    tokens: int  # prompt tokens it adds to the engine's prefill queue until its first token
    queued_ahead: float  # prefill tokens predicted ahead of it (`queued_ahead`)
    decoding: float
    sent_at: float
    queued_whole: float = 0.0  # the same, each prompt ahead counted whole until its first token
    first_token_at: float | None = None
    closed: bool = False
    # At its first token: the engine's decoding sequences and prefilled tokens so far.
    decoding_at_first: float = 0.0
    prefilled_at_first: int = 0
    # Its prefill makes the engine's steps longer than the ITL SLO (router/routing/goodput.py).
    stalls: bool = False
    clean_epoch: int = -1  # the engine's EngineLegs epoch it decoded in clean; -1: never clean
    # A split's place on its decoder while the producer computes the prompt: when its TTFT
    # SLO runs out (registry clock). A prefill sent there meanwhile runs ahead of its decode leg.
    kv_deadline: float | None = None
    # (lacking, held) prompt tokens, where known exactly when sent (the prompt tokenized, the
    # engine's KV-event index fresh): its speed sample is taken at its first token, not at its end.
    known_hits: tuple[int, int] | None = None
    taught: bool = False  # its first-token sample has taught the speed
    sent_no: int = 0  # its place in the order of legs sent to its engine (`EngineLegs.opened`)
    # Legs sent to its engine behind it before its first token, (seconds after it, prompt
    # tokens), where it may teach the speed: some may have shared its last prefill step.
    behind: tuple[tuple[float, int], ...] = ()
    owes_chain: bool = False  # it holds a credit for a chain of KV blocks (router/fleet/event_sequences.py)

    @property
    def nothing_ahead(self) -> bool:
        """Nothing was queued ahead of it when sent: its time to first token is its own, a
        clean sample of its engine's speed or (a split's decode leg) of the KV transfer. A
        prompt ahead counts until its first token: the progress `queued_ahead` predicts is
        the learned speed's own guess, so it must not decide which samples teach it."""
        return self.queued_whole < 1.0


@dataclass(slots=True)
class EngineLegs:
    """Per engine, what this router's legs there mean for goodput (router/routing/goodput.py):
    the decoding legs that no stalling prefill has run beside, and the splits whose decode
    legs are on their way (`awaiting_kv`: their KV is still being computed); and the legs
    without a first token yet (`unanswered`: what the engine may still be computing).

    Goodput counts a sequence lost at its first gap between tokens over the ITL SLO, so a
    prefill that stalls an engine's steps past the SLO costs only the sequences there that
    were within it until then (router/routing/goodput.py `pushed_past_itl`). A leg decoding
    on an engine while one of this router's stalling prefills is sent there and not through
    (no first token yet) is counted past the SLO for good: stalled, or about to be. Without
    this count every stall looked as costly as the first, and prompts that stall decoders
    were spread over all of them (each one's sequences just finished), where keeping them
    on the decoders already stalling keeps the others' sequences within the SLO."""

    clean: int = 0  # decoding legs within the ITL SLO so far
    stalling: int = 0  # stalling prefills sent and not through
    epoch: int = 0  # one more per stalling prefill: legs clean in an earlier epoch are not now
    awaiting_kv: list[LegTicket] = field(default_factory=list)
    # Legs sent and without a first token, oldest first (keyed by id: tickets compare by value).
    unanswered: dict[int, LegTicket] = field(default_factory=dict)
    sent: int = 0  # legs sent so far
    recent: deque[tuple[int, float, int]] = field(default_factory=lambda: deque(maxlen=RECENT_SENDS))

    @property
    def prefilling_since(self) -> float:
        """When the oldest leg still without a first token was sent (inf: none). A prompt
        the router sent here since may still be computing (`BackendView.prefilling_since`)."""
        oldest = next(iter(self.unanswered.values()), None)
        return float("inf") if oldest is None else oldest.sent_at

    def opened(self, ticket: LegTicket) -> None:
        self.sent += 1
        ticket.sent_no = self.sent
        self.recent.append((self.sent, ticket.sent_at, ticket.tokens))
        self.unanswered[id(ticket)] = ticket
        if ticket.kv_deadline is not None:
            self.awaiting_kv.append(ticket)
        if ticket.stalls:
            self.stalling += 1
            self.epoch += 1
            self.clean = 0

    def first_token(self, ticket: LegTicket) -> None:
        self.unanswered.pop(id(ticket), None)
        if ticket.stalls:
            self.stalling -= 1
        if self.stalling == 0:
            ticket.clean_epoch = self.epoch
            self.clean += 1

    def sent_behind(self, ticket: LegTicket, until: float) -> tuple[tuple[float, int], ...]:
        """The legs sent here after `ticket` and before `until` (clock), in the order sent:
        (seconds after it, prompt tokens)."""
        behind = []
        for sent_no, sent_at, tokens in reversed(self.recent):
            if sent_no <= ticket.sent_no:
                break
            if sent_at < until:
                behind.append((sent_at - ticket.sent_at, tokens))
        return tuple(reversed(behind))

    def kv_awaited_s(self, now: float) -> tuple[float, ...]:
        """Seconds until each awaited split's TTFT SLO runs out."""
        return tuple(t.kv_deadline - now for t in self.awaiting_kv if t.kv_deadline is not None)

    def closed(self, ticket: LegTicket) -> None:
        if ticket.kv_deadline is not None:
            self.awaiting_kv.remove(ticket)
        if ticket.first_token_at is None:
            self.unanswered.pop(id(ticket), None)
            if ticket.stalls:
                self.stalling -= 1
        elif ticket.clean_epoch == self.epoch:
            self.clean -= 1


def last_step_share(lacking: int, seconds: float, behind: tuple[tuple[float, int], ...], chunk: float) -> int:
    """Prompt tokens of legs sent behind a leg (`behind`: seconds after it, tokens) that its
    engine computed in the leg's last prefill step; `seconds`: its time to first token.

    vLLM fills each step's token budget (`chunk`, max_num_batched_tokens) from its waiting
    queue in arrival order, so a prompt of several chunks whose last is short shares that
    step with prompts sent while its earlier chunks ran, and its first token waits for
    their tokens too. Its steps are taken to last in proportion to their tokens (a step's
    fixed cost is small beside a full chunk's), so the last began after (chunks before it)
    / (all tokens of its steps) of its time; the speed learned so far cannot say when (it
    may be the prior, off by an order of magnitude). That start depends on the tokens it
    took, which depend on the start: two rounds bracket them, and their mean is taken."""
    if lacking <= chunk or not behind:
        return 0
    before_last = (math.ceil(lacking / chunk) - 1) * chunk
    room = int(before_last + chunk - lacking)

    def taken(shared: float) -> int:
        start = seconds * before_last / (lacking + shared)
        return min(sum(tokens for after, tokens in behind if after < start), room)

    most = taken(0.0)
    return (most + taken(most)) // 2


def first_token_sample(
    learner: SpeedLearner, ticket: LegTicket, lacking_tokens: int, held_tokens: int, chunk: float
) -> float | None:
    """One speed sample from a leg that reached its first token, now that its usage says
    how many prompt tokens it lacked and held. Returns the observed seconds to first
    token. The held tokens' load time (CPU tier) is the scraped counters' to explain,
    so it is taken out of the sample before it teaches the prefill speed. A leg teaches
    once: at its first token where its hits were known when sent (`known_hits`), else
    when its usage arrives at its end.

    Only a leg with nothing queued ahead of it teaches the speed: a prompt ahead counts
    whole until its first token, however much of it the engine has computed, so a leg sent
    late in another's prefill reads as fast (4,954 + 3,155 tokens in 1.2 s, where 4,954
    alone took 1.7 s). Such samples held the learned per-token cost at 180-245 us where
    the engines took 333 (bench/RESULTS.md). What the engine computed of prompts sent
    behind it in its last prefill step (`last_step_share`) counts with its own tokens:
    taken as its own, a burst's 586-token prompt that took 2.4 s (its second step filled by
    the prompts behind it) taught 4.4 ms a token where the engine took 2.7."""
    if ticket.first_token_at is None:
        return None
    seconds = ticket.first_token_at - ticket.sent_at
    if ticket.nothing_ahead and not ticket.taught:
        ticket.taught = True
        loading = learner.speed(ticket.backend).held_cost_s(held_tokens)
        lacking = max(lacking_tokens, 0)
        computed = lacking + last_step_share(lacking, seconds, ticket.behind, chunk)
        learner.observe_first_token(ticket.backend, computed, ticket.decoding, max(seconds - loading, 0.0))
    return seconds


def stalls_decoding(learner: SpeedLearner, ticket: LegTicket, slo: Slo | None, chunk: float) -> bool:
    """Does the leg's prefill, in chunks of `chunk` tokens, make its engine's steps longer
    than the ITL SLO (measured speeds)? Most legs prefill nothing (a race's probes): no
    speed is looked up for them."""
    if slo is None or ticket.tokens <= 0:
        return False
    name = ticket.backend
    return prefill_stalls(learner.speed(name), learner.itl(name), ticket.decoding, ticket.tokens, slo, chunk)


def decode_sample(
    learner: SpeedLearner, ticket: LegTicket, tokens: int, decoding_now: float, prefilled_now: int, now: float
) -> None:
    """A decode-step sample of an ended leg that generated `tokens` (speed_learner.py): the
    engine's decoding sequences averaged over the leg, less the prefills computed meanwhile."""
    if ticket.first_token_at is None or tokens < 2:
        return
    decoding = (ticket.decoding_at_first + decoding_now + 1.0) / 2.0
    learner.observe_decode(
        ticket.backend, decoding, tokens - 1, now - ticket.first_token_at, prefilled_now - ticket.prefilled_at_first
    )


def queued_ahead(
    own: float, since: float, others: float, scraped_at: float, now: float, speed: EngineSpeed
) -> tuple[float, float]:
    """Prefill tokens ahead of a request sent now to an engine, and the same with each
    prompt counted whole until its first token (what `LegTicket.nothing_ahead` reads):

    - `others`: other replicas' waiting requests as the last scrape (`scraped_at`) saw them,
      at the mean prompt length, less what the engine has prefilled at its measured `speed`
      since (a burst a scrape caught is gone a few hundred milliseconds later); they wait
      ahead of this router's legs, which count whole until they are through;
    - `own`: prompt tokens of this router's legs before their first token, less what the
      engine has prefilled since `since`, when it began on the oldest of them (the send to
      its empty queue, or the first token of the leg before: vLLM prefills its waiting
      queue in arrival order).

    Counted whole until its first token, a prompt deep in its prefill made its engine look
    a whole prompt busier than it was: a request sharing its prefix went to an idle engine
    to compute it again (many-tenants), and a burst's late requests were predicted at twice
    their time to first token (bursty: 9.3 s predicted, 4.8 s observed).

    Progress is credited only at a speed measured on the engine itself (its own fit, past
    `OWN_FIT_SAMPLES`): the prior, or the fleet's fit while it learns, can be off by an
    order of magnitude, and a queue drained in the model at a speed the engine does not
    have sent a whole burst to one engine (bursty: the prior's 10,000 tokens/s against
    the engines' ~370; 23 prompts onto one decoder, the last waiting 20 s)."""
    per_token_s = max(speed.per_token_s, MIN_PER_TOKEN_S)
    if others > 0.0:
        since = max(since, scraped_at + others * per_token_s)  # the engine is on this router's legs from then on
        others = max(others - max(now - scraped_at, 0.0) / per_token_s, 0.0)
    whole = own + others
    if others > 0.0 or own <= 0.0 or speed.samples < OWN_FIT_SAMPLES:
        return whole, whole
    done = (now - since - max(speed.intercept_s, 0.0)) / per_token_s
    return own - min(max(done, 0.0), own), whole
