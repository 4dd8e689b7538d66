"""Engines whose answers stall: avoided for a while, then given traffic again.

An engine can answer every request and every health check and still be no good: paused
(SIGSTOP, a stuck GPU, a host swapping), it sends each answer seconds late. Neither
failures nor the circuit breaker see that. Two signals do:
- a leg's first token arrives far later than the cost model predicted for that engine
  and its queue (`first_token`);
- a gap between two pieces of a streamed answer is far longer than one engine step
  (`token_gap`; the time spent writing to the client is not counted);
- a health check takes far longer than the other engines' checks of the same round
  (`check_round`): the whole router being slow makes every check of a round slow alike.

`STALLS_TO_SLOW` stalls within `WINDOW_S` mark the engine slow: it is not available for
`slow_s` (requests it is serving finish; when every engine is slow, panic routing still
uses them). Then it takes traffic again, its next answers its trial: stalling again
marks it slow for twice as long (up to `MAX_SLOW_S`); an engine that went `RESET_S`
without being marked starts again from `slow_s`.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

from router.routing.costmodel import EngineSpeed

log = logging.getLogger("cachehit_router.backends")

# A stall is late by more than this beyond the prediction (queueing is not a stall)...
STALL_LATE_S = 1.0
# ... and more than this many times the prediction.
STALL_FACTOR = 4.0
# A health check is stalled past this (and past STALL_FACTOR times the fleet's usual).
CHECK_STALL_S = 0.5
# The cost model's predictions are judged only once it measured the engine this many
# times (its priors can be far off: a first token "late" against a prior is no stall).
MIN_SAMPLES = 20
STALLS_TO_SLOW = 2
WINDOW_S = 30.0
MAX_SLOW_S = 60.0
RESET_S = 120.0


def is_stalled(observed_s: float, expected_s: float) -> bool:
    """A first token `observed_s` after its leg was sent, where `expected_s` was predicted."""
    return observed_s > STALL_LATE_S + expected_s and observed_s > STALL_FACTOR * expected_s


@dataclass
class _Engine:
    stalls: deque[float] = field(default_factory=deque)
    slow_until: float = 0.0
    slow_for_s: float = 0.0  # how long it was marked slow last time
    marked_at: float = -1e9


@dataclass
class StallWatch:
    """Per engine: its recent stalls and whether it is marked slow. `slow_s` 0: never."""

    slow_s: float = 5.0
    _engines: dict[str, _Engine] = field(default_factory=dict)

    def slow(self, name: str, now: float) -> bool:
        e = self._engines.get(name)
        return e is not None and now < e.slow_until

    def first_token(self, name: str, observed_s: float, expected_s: float, now: float, samples: int) -> None:
        """A leg's first token `observed_s` after it was sent; `samples`: the measurements
        behind `expected_s`."""
        if samples >= MIN_SAMPLES and is_stalled(observed_s, expected_s):
            self._stalled(name, now, f"first token after {observed_s:.2f} s, predicted {expected_s:.2f} s")

    def first_token_of(
        self, name: str, seconds: float, tokens: float, decoding: float, speed: EngineSpeed, now: float
    ) -> None:
        """`first_token` of a leg sent with `tokens` to prefill ahead of its first token and
        `decoding` sequences there, judged with the engine's measured `speed`."""
        self.first_token(name, seconds, speed.ttft(tokens, decoding), now, speed.samples)

    def token_gap(self, name: str, gap_s: float, step_s: float, now: float, samples: int) -> None:
        """A streamed answer waited `gap_s` for its next piece; `step_s`: one engine step."""
        if samples >= MIN_SAMPLES and is_stalled(gap_s, step_s):
            self._stalled(name, now, f"{gap_s:.2f} s between two tokens, a step takes {step_s:.3f} s")

    def check_round(self, took: dict[str, float], now: float) -> None:
        """One round of health checks, run together: name -> seconds each took. One far
        slower than the round's others stalls."""
        if len(took) < 2:
            return
        for name, seconds in took.items():
            usual = statistics.median(s for n, s in took.items() if n != name)
            if seconds > CHECK_STALL_S + usual and seconds > STALL_FACTOR * usual:
                self._stalled(name, now, f"health check took {seconds:.2f} s, the others' {usual:.3f} s")

    def forget(self, name: str) -> None:
        self._engines.pop(name, None)

    def _stalled(self, name: str, now: float, why: str) -> None:
        if self.slow_s <= 0:
            return
        e = self._engines.setdefault(name, _Engine())
        if now < e.slow_until:
            return
        e.stalls.append(now)
        while e.stalls and now - e.stalls[0] > WINDOW_S:
            e.stalls.popleft()
        if len(e.stalls) < STALLS_TO_SLOW:
            return
        e.stalls.clear()
        fresh = now - e.marked_at > RESET_S
        e.slow_for_s = self.slow_s if fresh else min(2 * e.slow_for_s, MAX_SLOW_S)
        e.slow_until, e.marked_at = now + e.slow_for_s, now
        log.warning("backend %s: its answers stall (%s); avoided for %g s", name, why, e.slow_for_s)
