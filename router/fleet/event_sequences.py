"""Sequences running on an engine that this router did not send, as the engine's KV events
show them: other router replicas' traffic (and clients that bypass the router) seen as it
happens, not only at the next scrape.

Why: the scrapes (router/fleet/others.py) come every 0.5-1 s; at low load the last one
mostly saw none of others' traffic, so a cold prompt went where another replica had just
started a sequence, and its prefill stalled that sequence past the ITL SLO.

What the events say: an engine with prefix caching stores every full block a sequence
computes, its prompt's and, as it decodes, its output's (vLLM caches decoded blocks too),
each `BlockStored` chained to the block before it by `parent_block_hash`. A chain whose
tail keeps growing is a sequence running there; a chain that begins (no parent, or a parent
that is no chain's tail: a prefix shared with other prompts) is a sequence that began.

Whose: a beginning is this router's if one of its legs there still owes one (a credit).
A leg sent to prefill tokens owes one from when it is sent; a leg with nothing to prefill
when sent (a probe, a split's decode leg) from its first token, when the engine took it,
and that credit may also claim a beginning of the last `REPAY_S` counted as others' (the
event can arrive before the first token it goes with). A leg that ends without its
beginning leaves its credit for `GRACE_S` (its events may still be on their way); a race's
leg dropped once its engine may have begun on it (lost, expired) owes one then. Counted
credits, not matched prompts: no hashing of the router's own prompts on the hot path.
Blocks stored again (the same hashes: a preempted sequence computing what it lost) are no
beginning: they are their first owner's.

Live: others' chains that grew within the window, `WINDOW_BLOCKS` times the engine's
measured time between two one-block stores of a chain (its decode speed for a block), so
a sequence that finished stops counting within about two blocks' time.

Unseen: a prompt's first blocks are stored when its first prefill step ends, so others'
prompts still computing show nothing yet. How many there are is expected from what the
events showed lately: others' beginnings per second and the prompt tokens they computed
per second (the blocks of each beginning), times the engine's seconds per prompt and per
token (`unseen_prefills`): the share of its time spent on others' prompts not yet shown.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.fleet.decayed_rate import DecayedRate
from router.fleet.others import OTHERS_SEEN_S

EngineHash = bytes | int
_GPU_MEDIA = (None, "GPU")  # a CPU tier's copy of a block is no sequence growing

# A credit taken up by a beginning read this long before it (the event beat the first token).
REPAY_S = 0.5
# A credit left by a leg that ended without its beginning: its last events in flight.
GRACE_S = 0.5
# A live chain grew within this many of its engine's block times.
WINDOW_BLOCKS = 2.0
# The block time before any was measured: 16-32 tokens at a GPU's 20-30 ms.
PRIOR_BLOCK_S = 0.5
MIN_WINDOW_S, MAX_WINDOW_S = 0.05, 5.0
BLOCK_WEIGHT = 0.1  # each one-block store's weight in the block time's mean
# Chains whose tail grew within this long are still known (a slow one's next block is
# still its own); the rest are forgotten, at most MAX_TAILS kept.
RETAIN_S = 30.0
MAX_TAILS = 65_536
MAX_BLOCKS = 65_536  # blocks remembered, whose storing again is no beginning (a million tokens)


@dataclass(slots=True)
class EventSequences:
    """One engine's chains of stored blocks, and whose each one is."""

    block_s: float = PRIOR_BLOCK_S
    block_samples: int = 0
    began_others: int = 0  # sequences others began there, ever (a gauge reads it)
    last_others_at: float = -1e9  # when others last began one (clock)
    # Every chain's tail -> (last stored at, began at, others', its first store's tokens),
    # the oldest store first.
    _tails: dict[EngineHash, tuple[float, float, bool, int]] = field(default_factory=dict)
    _live: dict[EngineHash, float] = field(default_factory=dict)  # others' tails -> last stored, within the window
    _credits: int = 0  # beginnings owed by open legs
    _credited_open: int = 0  # open legs that took a credit
    _left: deque[float] = field(default_factory=deque)  # credits of ended legs, expiring then
    _blocks: dict[EngineHash, bool] = field(default_factory=dict)  # blocks stored lately -> others'
    # Others' beginnings per second, and the prompt tokens of their first stores per second.
    _began: DecayedRate = field(default_factory=DecayedRate)
    _began_tokens: DecayedRate = field(default_factory=DecayedRate)

    # --- the router's own legs ---------------------------------------------------------------
    def owe(self, now: float, at_first_token: bool = False) -> None:
        """A leg of this router there will begin a chain (see the module's docstring); one
        credited at its first token may claim a beginning already counted as others'."""
        self._credited_open += 1
        if not (at_first_token and self._repay(now)):
            self._credits += 1

    def settle(self, now: float) -> None:
        """A leg that took a credit ended: an unspent credit lingers for `GRACE_S`."""
        self._credited_open = max(self._credited_open - 1, 0)
        if self._credits > self._credited_open:
            self._credits -= 1
            self._left.append(now + GRACE_S)

    def owed(self, now: float) -> int:
        """Beginnings this router's legs still owe there (open, or ended within `GRACE_S`)."""
        return self._credits + sum(1 for t in self._left if t >= now)

    def _repay(self, now: float) -> bool:
        """Claim others' youngest beginning of the last `REPAY_S`, if any."""
        tails = self._tails
        for tail, (stored, began, others, first) in reversed(tails.items()):
            if now - stored > REPAY_S:
                return False  # ordered by the last store, and a chain begins before it grows
            if others and now - began <= REPAY_S:
                tails[tail] = (stored, began, False, first)
                self._live.pop(tail, None)
                self.began_others -= 1
                self._began.add(-1.0, now)
                self._began_tokens.add(-float(first), now)
                return True
        return False

    def _own_beginning(self, now: float) -> bool:
        if self._credits > 0:
            self._credits -= 1
            return True
        left = self._left
        while left and left[0] < now:
            left.popleft()
        if left:
            left.popleft()
            return True
        return False

    # --- the engine's events -----------------------------------------------------------------
    def stored(self, parent: EngineHash | None, hashes: Sequence[EngineHash], now: float, tokens: int = 0) -> None:
        """A GPU `BlockStored` of blocks `hashes` (`tokens` tokens), chained after `parent`."""
        tails, tail = self._tails, hashes[-1]
        again = self._blocks.get(hashes[0])
        if again is not None:
            # A block this engine stored before, stored again: a sequence computing again what
            # it lost (preempted, its blocks evicted), or another prompt of the same tokens.
            # The same owner's, unless a leg of this router still owes its beginning.
            others = again and not self._own_beginning(now)
            entry = tails.pop(parent, None) if parent is not None else None
            tails[tail] = (now, now if entry is None else entry[1], others, tokens if entry is None else entry[3])
            live = self._live
            live.pop(tail, None)
            if parent is not None:
                live.pop(parent, None)
            if others:
                live[tail] = now
            self._remember(hashes, others, now)
            return
        if parent is not None:
            entry = tails.pop(parent, None)
            if entry is not None:
                gap = now - entry[0]
                if len(hashes) == 1 and 0.0 < gap <= MAX_WINDOW_S:  # a decoded block: the block time
                    self.block_s += BLOCK_WEIGHT * (gap - self.block_s)
                    self.block_samples += 1
                others = entry[2]
                if not others or gap <= self.window_s:
                    tails[tail] = (now, entry[1], others, entry[3])
                    if others:
                        self._live.pop(parent, None)
                        self._live[tail] = now
                    self._remember(hashes, others, now)
                    return
                # Others' chain idle past the window, taken up again (a conversation's next
                # turn, perhaps through this router): a beginning, whoever's it is.
        others = not self._own_beginning(now)
        tails[tail] = (now, now, others, tokens)
        if others:
            self._live[tail] = now
            self.began_others += 1
            self.last_others_at = now
            self._began.add(1.0, now)
            self._began_tokens.add(float(tokens), now)
        self._remember(hashes, others, now)

    def _remember(self, hashes: Sequence[EngineHash], others: bool, now: float) -> None:
        blocks = self._blocks
        blocks.update(dict.fromkeys(hashes, others))
        while len(blocks) > MAX_BLOCKS:
            del blocks[next(iter(blocks))]
        tails = self._tails
        while tails and (len(tails) > MAX_TAILS or now - next(iter(tails.values()))[0] > RETAIN_S):
            del tails[next(iter(tails))]

    def cleared(self) -> None:
        """The engine's cache is gone (a reset, a restart): no chain grows any more."""
        self._tails.clear()
        self._live.clear()
        self._blocks.clear()

    # --- what the planners read --------------------------------------------------------------
    @property
    def window_s(self) -> float:
        return min(max(WINDOW_BLOCKS * self.block_s, MIN_WINDOW_S), MAX_WINDOW_S)

    def others_running(self, now: float) -> int:
        """Others' chains that grew within the window: their sequences running there now."""
        live, window = self._live, self.window_s
        while live and now - next(iter(live.values())) > window:
            del live[next(iter(live))]
        return len(live)

    def others_rates(self, now: float) -> Rates:
        """Others' beginnings per second there lately, and their first stores' tokens per second."""
        if now - self.last_others_at > OTHERS_SEEN_S:
            return 0.0, 0.0
        return max(self._began.per_s(now), 0.0), max(self._began_tokens.per_s(now), 0.0)

    def others_seen(self, now: float) -> bool:
        """Has the engine begun others' sequences lately (the router's memory of it is then
        incomplete: router/fleet/others.py)?"""
        return now - self.last_others_at <= OTHERS_SEEN_S


def follow_sequences(seqs: EventSequences, events: Iterable[Any], now: float) -> None:
    """A live batch's events (router/engine/kv_events_wire.py) into `seqs`."""
    for ev in events:
        kind = getattr(ev, "kind", "")
        if kind == "stored":
            hashes = ev.block_hashes
            if hashes and not ev.group_idx and ev.medium in _GPU_MEDIA:
                seqs.stored(ev.parent_block_hash, hashes, now, len(hashes) * ev.block_size)
        elif kind == "cleared":
            seqs.cleared()


Rates = tuple[float, float]  # others' beginnings per second, their first stores' tokens per second


def fleet_rates(rates: Sequence[Rates]) -> Rates:
    """The mean over the decoders that publish events of their `others_rates`."""
    if not rates:
        return 0.0, 0.0
    return sum(r[0] for r in rates) / len(rates), sum(r[1] for r in rates) / len(rates)


def unseen_prefills(own: Rates, fleet: Rates, per_prompt_s: float, per_token_s: float) -> float:
    """Others' prompts expected to be computing on an engine now, not yet shown by a store:
    the rate they begin at times each one's fixed cost, plus the rate of their prompt tokens
    times the cost of one (the engine's speed). The rate is the engine's own (`own`) or,
    where higher, the decoders' mean (`fleet`): an engine that shows none of others' prompts
    yet is as likely as any to be getting one (their routers see it idle too)."""
    return max(own[0], fleet[0]) * per_prompt_s + max(own[1], fleet[1]) * per_token_s
