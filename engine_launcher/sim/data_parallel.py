"""Data parallelism: one server, N engine cores (`--data-parallel-size N`), as vLLM runs
them: each rank has its own KV cache, scheduler and metrics (labelled `engine="<rank>"`), and
publishes its KV events on the configured ports offset by its rank. A request that names a
rank in vLLM's `X-data-parallel-rank` header goes there (an out-of-range or malformed rank
is vLLM's 400); one without goes to the least loaded rank, as vLLM's own DP load balancer
sends it (waiting requests weigh 4, running 1), ties to the next rank in turn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .api_errors import ApiError
from .config import SimEngineConfig
from .engine import SimEngine

DP_RANK_HEADER = "X-data-parallel-rank"


def rank_configs(config: SimEngineConfig) -> list[SimEngineConfig]:
    """One engine config per rank. The adapters and the faults stay shared: they are the
    server's, not a rank's."""
    events = config.kv_events_config
    return [
        dataclasses.replace(
            config, data_parallel_rank=rank, kv_events_config=events.for_rank(rank) if events is not None else None
        )
        for rank in range(config.data_parallel_size)
    ]


class RankPicker:
    """Which rank serves a request."""

    def __init__(self, engines: Sequence[SimEngine]) -> None:
        self.engines = engines
        self._turn = 0

    def pick(self, headers: Mapping[str, str]) -> SimEngine:
        raw = headers.get(DP_RANK_HEADER)
        n = len(self.engines)
        if raw is not None:
            try:
                rank = int(raw)
            except ValueError:
                rank = -1
            if not 0 <= rank < n:
                raise ApiError(f"data_parallel_rank {raw} is out of range [0, {n}).", 400, "BadRequestError")
            return self.engines[rank]
        if n == 1:
            return self.engines[0]
        self._turn = (self._turn + 1) % n
        order = [self.engines[(self._turn + i) % n] for i in range(n)]
        return min(order, key=lambda e: 4 * e.num_waiting + e.num_running)


class MergedRegistry:
    """The ranks' metric registries as one exposition: each family once, its samples from
    every rank (told apart by their `engine` label)."""

    def __init__(self, engines: Sequence[SimEngine]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Any]:
        families: dict[str, Any] = {}
        for engine in self.engines:
            for family in engine.metrics.registry.collect():
                seen = families.get(family.name)
                if seen is None:
                    families[family.name] = family
                else:
                    seen.samples.extend(family.samples)
        yield from families.values()
