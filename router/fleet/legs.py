"""One leg's place in its engine's load (`LegTicket`): what the registry
(router/fleet/registry.py) counts from `open_leg` to `close_leg`, the cost model's
inputs when the leg was sent, and the speed samples a leg makes."""

from __future__ import annotations

from dataclasses import dataclass

from router.routing.speed_learner import SpeedLearner


@dataclass(slots=True)
class LegTicket:
    """One leg's place in its engine's load, from `open_leg` to `close_leg`.

    `queued_ahead` and `decoding` are the cost model's inputs when the leg was sent: with
    the tokens it lacked and its time to first token they make one speed sample."""

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


def first_token_sample(learner: SpeedLearner, ticket: LegTicket, lacking_tokens: int, held_tokens: int) -> float | None:
    """One speed sample from a leg that reached its first token, now that its usage says
    how many prompt tokens it lacked and held. Returns the observed seconds to first
    token. The held tokens' load time (CPU tier) is the scraped counters' to explain,
    so it is taken out of the sample before it teaches the prefill speed."""
    if ticket.first_token_at is None:
        return None
    seconds = ticket.first_token_at - ticket.sent_at
    loading = learner.speed(ticket.backend).held_cost_s(held_tokens)
    learner.observe_first_token(
        ticket.backend, ticket.queued_ahead + max(lacking_tokens, 0), ticket.decoding, max(seconds - loading, 0.0)
    )
    return seconds


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
