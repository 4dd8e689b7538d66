"""Traffic on an engine that this router did not send (other router replicas, clients that
bypass it), as the router's scrapes of the engine's /metrics show it.

A scrape counts the engine's running and waiting requests; what this router's own legs
do not explain is others'. Between scrapes the router sees none of it, so where an
engine serves others' traffic the count of their decoding sequences is at least its
mean over recent scrapes: a sequence another replica started since the last scrape is
unseen until the next. (Counted from the last scrape alone, at low load it mostly saw
none, and a cold prompt went where it stalled their sequences past the ITL SLO.)

A scrape's counts are as old as its read: legs of this router that ended while it was on
its way may still be among them, and they are this router's (`BackendRegistry.record_scrape`
counts them with its own decoding legs). Counted as others', each marked its engine shared
for `OTHERS_SEEN_S` with a phantom sequence on it.
"""

from __future__ import annotations

from dataclasses import dataclass

# How long traffic the router did not send keeps an engine marked as shared with others:
# the router's own memory of it is then incomplete.
OTHERS_SEEN_S = 60.0
# The weight of each scrape in the mean of others' running sequences: about the last five
# scrapes' (2.5-5 s at the usual intervals), long enough to span a sequence's life.
MEAN_WEIGHT = 0.2


@dataclass(slots=True)
class OthersLoad:
    """Others' requests on one engine at its last scrape, and their running mean."""

    waiting: float = 0.0
    running: float = 0.0
    running_mean: float = 0.0
    seen_at: float = -1e9  # the last scrape that saw a whole request of others' (clock)

    def observe(self, running: float, waiting: float, own_prefilling: float, own_decoding: float, now: float) -> None:
        """A scrape's counts, less this router's own legs: waiting first (its prefilling
        legs may sit in either queue), the rest running."""
        others = max(running + waiting - own_prefilling - own_decoding, 0.0)
        self.waiting = min(others, max(waiting - own_prefilling, 0.0))
        self.running = others - self.waiting
        self.running_mean += MEAN_WEIGHT * (self.running - self.running_mean)
        if others >= 1.0:
            self.seen_at = now

    def seen(self, now: float) -> bool:
        """Has the engine served others' traffic lately?"""
        return now - self.seen_at <= OTHERS_SEEN_S

    def decoding(self, now: float) -> float:
        """Others' sequences decoding on the engine now, as far as the router can tell: those
        the last scrape saw, and at least their mean where the engine serves others."""
        return max(self.running, self.running_mean) if self.seen(now) else self.running
