"""`probe`: ask the engines whether they hold the prompt, by racing probes at the cache-hit
threshold where the cost model says a race is worth its wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from router.config.checks import Problems, check_fraction, check_one_of, check_positive
from router.config.schema import RoutingConfig
from router.names import Mode, RaceReason
from router.routing import costmodel
from router.routing.planning import (
    Plan,
    RemembersPrefixes,
    RouteQuery,
    decoders_for,
    direct_plan,
    fastest,
    predicted_ttft,
)
from router.routing.prefix_memory import PrefixMemory
from router.routing.snapshot import ClusterSnapshot

# Of the requests whose race the learned figures call not worth it, one in this many races
# anyway, so that what races are worth keeps being measured as traffic changes.
EXPLORE_ONE_IN = 16

# A prompt the router sent an engine this recently may still be in its prefill, cached
# in no block yet and so in no KV event: the memory's expectation stands for it.
IN_FLIGHT_S = 5.0

# The race deadline allows an acceptor this many times its predicted time to first token:
# predictions are medians, and an acceptor cut off at the deadline costs a whole fallback.
DEADLINE_MARGIN = 2.0


@dataclass(frozen=True)
class ProbeSettings:
    """The `[routing]` keys the probe policy reads (docs/CONFIG.md)."""

    # "auto": race when the measured saving of past races outweighs waiting for verdicts;
    # "always": race every request (the engines are the only index the router trusts).
    race: Mode = Mode.AUTO
    # Fraction of the prompt an engine must already hold to accept a probe.
    cache_hit_threshold: float = 0.5
    # Race deadline floor; the cost model adds twice the slowest probed engine's predicted
    # time to first token as an acceptor. Silent engines then count as rejections.
    probe_deadline_ms: float = 250.0
    # Engines whose scraped waiting queue exceeds this are not probed (0: no bound).
    max_probe_waiting: int = 0
    # Probe at most this many engines per request (0: every available decode engine), the
    # ones with the least predicted time as acceptors: bounds a race's cost on large fleets.
    max_probes: int = 0


class ProbeStrategy(RemembersPrefixes):
    """Ask the engines: probe the decode backends at threshold T.

    Which ones, from the cost model: an engine that accepts holds at least T of the prompt
    (or what the prefix memory expects it to hold, if more), so its predicted time to first
    token as an acceptor is ttft(queue, prompt - max(T * prompt, expected hit)). It is probed
    only if that is no later than the best engine computing the whole prompt: an acceptor
    slower than that can only make the request wait. (The bound leaves the memory out: it
    may be stale, and an engine it wrongly favours must not keep the others from being
    asked.) With `max_probes` the qualifying engines are ranked by that prediction; with
    `max_probe_waiting` engines with a longer scraped queue are skipped.

    Whether to race at all: a race is worth what the engines know that the router does not
    (a prefix another replica sent, an eviction the memory missed, a CPU-tier copy). The
    router measures it (`race_value`): the share of the prompt's prefill time that racing
    saved over the cold choice. The request races if that share of its prefill time on the
    cold choice is more than what waiting for verdicts has cost (`race_wait_s`); otherwise it
    goes straight to the cold choice, as does one whose prompt is too short for any hit to
    beat the wait. One in `EXPLORE_ONE_IN` of the skipped requests races anyway, so the
    measurement follows the traffic.

    The prefix memory (`on_routed`) also serves the fallback: an engine still computing a
    cold prompt rejects a follower sharing its prefix (the blocks are not cached yet), so
    `expected_hits` adds what the engines will hold to what they said they hold.
    """

    name = "probe"
    Settings = ProbeSettings
    reads_index = True

    def __init__(
        self, routing: RoutingConfig, settings: ProbeSettings | None = None, memory: PrefixMemory | None = None
    ):
        self.config = settings or ProbeSettings()
        self.memory = memory or PrefixMemory(max_bytes=routing.prefix_memory_bytes)

    @staticmethod
    def check(settings: ProbeSettings, problems: Problems) -> None:
        problems.check(check_one_of, "routing.race", settings.race, Mode)
        problems.check(check_fraction, "routing.cache_hit_threshold", settings.cache_hit_threshold)
        problems.check(check_positive, "routing.probe_deadline_ms", settings.probe_deadline_ms)
        problems.check(check_positive, "routing.max_probe_waiting", settings.max_probe_waiting, allow_zero=True)
        problems.check(check_positive, "routing.max_probes", settings.max_probes, allow_zero=True)

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        decoders = decoders_for(query, snap, exclude)
        if not decoders:
            return Plan()
        # Engines without the threshold would accept every probe: never probed, only sent
        # to directly when no engine can be probed, or as a fallback.
        n = query.tokens(snap)
        hits = self.expected_hits(query, n)
        capable = [b for b in decoders if b.threshold_capable]
        if not capable:
            return replace(direct_plan(query, snap, decoders, hits), race_reason=RaceReason.NO_PROBE_ENGINE)
        decoders = capable
        bound = self.config.max_probe_waiting
        if bound:
            decoders = [b for b in decoders if b.waiting <= bound] or decoders
        cold = direct_plan(query, snap, decoders, hits)
        assert cold.predicted_ttft_s is not None
        assert cold.direct is not None
        best = snap.get(cold.direct)
        # What the memory expects is a guess (engines evict; other replicas route too), so
        # the most a race can save is the whole prompt's prefill on the cold choice.
        placed = any(v > 0.0 for v in hits.values())
        skip = replace(cold, skipped_race=True, placed=placed)
        auto = self.config.race == Mode.AUTO
        # An engine the KV-event index speaks for (fresh, this prompt matched) has its
        # answer known: asking it adds nothing. The others may hold what the index cannot
        # see (no stream, a stream behind or just restarted, another router's index).
        known = set(query.indexed or ()) if auto else set()
        unknown = [b for b in decoders if b.name not in known]
        if not unknown:
            return replace(skip, race_reason=RaceReason.INDEX_KNOWS)
        if auto and query.indexed is None and not self.wants_index(query, snap):
            # What the index would say, the memory knows (wants_index): so would a race.
            return replace(skip, race_reason=RaceReason.MEMORY_KNOWS)
        most = 0.0 if best is None else costmodel.hit_saving_s(best.speed, n)
        if auto:
            if most <= snap.race_wait_s:
                return replace(skip, race_reason=RaceReason.SHORT_PROMPT)
            share = snap.race_saving_share if placed else snap.race_saving_share_unplaced
            if share * most <= snap.race_wait_s and query.salt % EXPLORE_ONE_IN:
                return replace(skip, race_reason=RaceReason.NOT_WORTH)
        t = self.config.cache_hit_threshold
        # Worth asking: an engine that, as an acceptor, beats both computing the prompt
        # afresh and the best choice the known holders give.
        _, from_scratch = fastest(decoders, lambda b: n, query.salt)
        to_beat = min(from_scratch, cold.predicted_ttft_s) if known else from_scratch
        as_acceptor = [(predicted_ttft(b, n - max(t * n, hits.get(b.name, 0.0)), n), b) for b in unknown]
        worth = [(s, b) for s, b in as_acceptor if s <= to_beat]
        if not worth:
            return replace(skip, race_reason=RaceReason.INDEX_KNOWS if known else RaceReason.NO_ACCEPTOR)
        limit = self.config.max_probes
        if limit and len(worth) > limit:
            k = len(decoders)
            order = {b.name: i for i, b in enumerate(decoders)}
            worth.sort(key=lambda sb: (sb[0], (order[sb[1].name] - query.salt) % k))
            worth = worth[:limit]
        # Deadline: the slowest probed engine's predicted time as an acceptor, with margin,
        # on top of the configured floor; it grows with the prompt once a rejection says
        # how long the prompt is (the estimate from characters may be short).
        slowest = max(b.speed.per_token_s for _, b in worth)
        return Plan(
            probes=tuple(b.name for _, b in worth),
            threshold=t,
            deadline_s=self.config.probe_deadline_ms / 1000.0 + DEADLINE_MARGIN * max(s for s, _ in worth),
            deadline_per_prompt_token_s=DEADLINE_MARGIN * (1.0 - t) * max(slowest, costmodel.MIN_PER_TOKEN_S),
            probe_ttft_s=tuple(s for s, _ in worth),
            cold=cold.direct,
            cold_ttft_s=cold.predicted_ttft_s,
            scratch_ttft_s=from_scratch,
            placed=placed,
            race_reason=RaceReason.RACED if auto else RaceReason.ALWAYS,
        )

    def wants_index(self, query: RouteQuery, snap: ClusterSnapshot) -> bool:
        """Is the index worth its lookup for this prompt? Not when the router's own memory
        already says what it would: the memory places the prompt on an engine whose index
        is fresh and that has lost no block since the router sent it there (so it still
        holds it), and no engine serves traffic this router did not send (so no other
        engine can hold more than the memory knows). Then the plan is the same either way,
        and the /tokenize round trip is saved."""
        if any(b.others_seen for b in snap.backends if b.decodes):
            return True
        share, sent_at = self.memory_for(query).placement(query.text)
        if share <= 0.0:
            return True  # nothing placed: only the engines' events can say (a restart, a new router)
        for name, sent in sent_at.items():
            b = snap.get(name)
            if b is not None and b.available and b.kv_events_fresh and b.kv_removed_at < sent:
                return False
        return True

    def expected_hits(
        self, query: RouteQuery, prompt_tokens: float, sent_since: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """The prefix memory's expectations, with the KV-event index's exact figures for the
        engines it speaks for, raised to the memory's where the router sent the prompt
        there so recently that the engine may still be computing it (no event yet)."""
        remembered = self.memory_for(query).expected_hits(query.text, prompt_tokens, sent_since=sent_since)
        if not query.indexed:
            return remembered
        recent = self.memory_for(query).expected_hits(query.text, prompt_tokens, IN_FLIGHT_S)
        merged = {**remembered, **query.indexed}
        for name, tokens in recent.items():
            merged[name] = max(merged.get(name, 0.0), tokens)
        return merged


POLICY = ProbeStrategy
