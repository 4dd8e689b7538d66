"""A rate of what happened lately (`DecayedRate`): an exponentially decayed sum over about the
last `window_s`, read per second with the start-up bias removed (before a window has passed,
the sum holds less than a window's worth: divided by the time it has covered, not by the
whole window, it is not read low).

Its uses: the prompt work this router has asked of its engines lately, in tokens per second,
what goodput's producers to spare are judged against (router/routing/goodput.py
`spare_producers`; `BackendRegistry.prompt_work`), and others' prompts beginning on a decoder
(router/fleet/event_sequences.py). The prompt work is counted as each leg that will prefill is sent (`BackendRegistry.open_leg`: a split's
producer leg, a decoder computing a prompt; probes and decode legs carry no tokens), so
it is the work asked for, not the work done: counted at first tokens, the rate could not
pass what the engines complete, which is what it must tell apart from the demand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# About one burst and its silence in the suite's bursty traffic, a few prompts' prefills.
WINDOW_S = 10.0


@dataclass(slots=True)
class DecayedRate:
    window_s: float = WINDOW_S
    _sum: float = 0.0
    _at: float | None = None  # the last sample
    _since: float | None = None  # the first sample

    def add(self, amount: float, now: float) -> None:
        if self._since is None:
            self._since = now
        self._sum = self._decayed(now) + amount
        self._at = now

    def per_s(self, now: float) -> float:
        if self._since is None:
            return 0.0
        covered = self.window_s * -math.expm1(-max(now - self._since, 0.0) / self.window_s)
        # The first samples cover next to no time: counted over 1 s at least, not as a flood.
        return self._decayed(now) / max(covered, min(1.0, self.window_s))

    def _decayed(self, now: float) -> float:
        if self._at is None or now <= self._at:
            return self._sum
        return self._sum * math.exp(-(now - self._at) / self.window_s)
