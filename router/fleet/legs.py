"""One leg's place in its engine's load (`LegTicket`): what the registry
(router/fleet/registry.py) counts from `open_leg` to `close_leg`, and the cost model's
inputs when the leg was sent."""

from __future__ import annotations

from dataclasses import dataclass


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
