"""One leg's place in its engine's load (`LegTicket`): what the registry
(router/fleet/registry.py) counts from `open_leg` to `close_leg`, the cost model's
inputs when the leg was sent, the speed samples a leg makes, and per engine what its legs
mean for goodput (`EngineLegs`): decoding legs a stalling prefill already pushed past the
ITL SLO, splits whose KV is on its way."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.routing.goodput import Slo, prefill_stalls
from router.routing.speed_learner import SpeedLearner


@dataclass(slots=True)
class LegTicket:
    """One leg's place in its engine's load, from `open_leg` to `close_leg`.

    `queued_ahead` and `decoding` are the cost model's inputs when the leg was sent; a leg
    sent with nothing queued ahead (`nothing_ahead`) makes, with the tokens it lacked and
    its time to first token, one speed sample."""

    backend: str
    tokens: int  # prompt tokens it adds to the engine's prefill queue until its first token
    queued_ahead: float
    decoding: float
    sent_at: float
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

    @property
    def nothing_ahead(self) -> bool:
        """Nothing was queued ahead of it when sent: its time to first token is its own, a
        clean sample of its engine's speed or (a split's decode leg) of the KV transfer."""
        return self.queued_ahead < 1.0


@dataclass(slots=True)
class EngineLegs:
    """Per engine, what this router's legs there mean for goodput (router/routing/goodput.py):
    the decoding legs that no stalling prefill has run beside, and the splits whose decode
    legs are on their way (`awaiting_kv`: their KV is still being computed).

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

    def opened(self, ticket: LegTicket) -> None:
        if ticket.kv_deadline is not None:
            self.awaiting_kv.append(ticket)
        if ticket.stalls:
            self.stalling += 1
            self.epoch += 1
            self.clean = 0

    def first_token(self, ticket: LegTicket) -> None:
        if ticket.stalls:
            self.stalling -= 1
        if self.stalling == 0:
            ticket.clean_epoch = self.epoch
            self.clean += 1

    def kv_awaited_s(self, now: float) -> tuple[float, ...]:
        """Seconds until each awaited split's TTFT SLO runs out."""
        return tuple(t.kv_deadline - now for t in self.awaiting_kv if t.kv_deadline is not None)

    def closed(self, ticket: LegTicket) -> None:
        if ticket.kv_deadline is not None:
            self.awaiting_kv.remove(ticket)
        if ticket.first_token_at is None:
            if ticket.stalls:
                self.stalling -= 1
        elif ticket.clean_epoch == self.epoch:
            self.clean -= 1


def first_token_sample(learner: SpeedLearner, ticket: LegTicket, lacking_tokens: int, held_tokens: int) -> float | None:
    """One speed sample from a leg that reached its first token, now that its usage says
    how many prompt tokens it lacked and held. Returns the observed seconds to first
    token. The held tokens' load time (CPU tier) is the scraped counters' to explain,
    so it is taken out of the sample before it teaches the prefill speed.

    Only a leg with nothing queued ahead of it teaches the speed: a prompt ahead counts
    whole until its first token, however much of it the engine has computed, so a leg sent
    late in another's prefill reads as fast (4,954 + 3,155 tokens in 1.2 s, where 4,954
    alone took 1.7 s). Such samples held the learned per-token cost at 180-245 us where
    the engines took 333 (bench/RESULTS.md)."""
    if ticket.first_token_at is None:
        return None
    seconds = ticket.first_token_at - ticket.sent_at
    if ticket.nothing_ahead:
        loading = learner.speed(ticket.backend).held_cost_s(held_tokens)
        learner.observe_first_token(
            ticket.backend, max(lacking_tokens, 0), ticket.decoding, max(seconds - loading, 0.0)
        )
    return seconds


def stalls_decoding(learner: SpeedLearner, ticket: LegTicket, slo: Slo | None) -> bool:
    """Does the leg's prefill make its engine's steps longer than the ITL SLO (measured speeds)?
    Most legs prefill nothing (a race's probes): no speed is looked up for them."""
    if slo is None or ticket.tokens <= 0:
        return False
    name = ticket.backend
    return prefill_stalls(learner.speed(name), learner.itl(name), ticket.decoding, ticket.tokens, slo)


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
