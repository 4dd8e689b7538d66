"""The gauges of the engines' KV-event streams and of the router's block index
(router/fleet/kv_events.py, router/routing/kv_index.py), bound per backend and read when
scraped. The cumulative counts (gaps, replays...) are gauges reading the stream's own
counters, like the other per-backend gauges."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge


# What the gauges read, as protocols: this layer sits below the fleet and the index.
class KvStreamGauges(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def lag_s(self) -> float: ...
    @property
    def gaps(self) -> int: ...
    @property
    def replays(self) -> int: ...
    @property
    def restarts(self) -> int: ...
    @property
    def decode_errors(self) -> int: ...


class _KvBlocks(Protocol):
    @property
    def gpu_blocks(self) -> int: ...
    @property
    def cpu_blocks(self) -> int: ...
    @property
    def orphans(self) -> int: ...


class SequenceGauges(Protocol):
    @property
    def began_others(self) -> int: ...
    @property
    def block_s(self) -> float: ...


class KvIndexGauges(Protocol):
    def stats(self, backend: str) -> _KvBlocks: ...


class KvEventGauges:
    def __init__(self, r: CollectorRegistry) -> None:
        self.lag = Gauge(
            "cachehit_router_kv_events_lag_seconds",
            "Age of the engine's last KV-event batch when it arrived (router clock - engine's batch ts)",
            ["backend"],
            registry=r,
        )
        self.fresh = Gauge(
            "cachehit_router_kv_events_fresh",
            "1 while the engine's KV-event index is in sync and current (planners trust it)",
            ["backend"],
            registry=r,
        )
        self.gaps = Gauge(
            "cachehit_router_kv_events_gaps", "Sequence gaps in the engine's KV-event stream", ["backend"], registry=r
        )
        self.replays = Gauge(
            "cachehit_router_kv_events_replays",
            "Replay requests sent to the engine's replay socket",
            ["backend"],
            registry=r,
        )
        self.restarts = Gauge(
            "cachehit_router_kv_events_restarts",
            "Times the engine's KV-event sequence went back (an engine restart)",
            ["backend"],
            registry=r,
        )
        self.decode_errors = Gauge(
            "cachehit_router_kv_events_decode_errors",
            "KV-event messages from the engine that did not decode",
            ["backend"],
            registry=r,
        )
        self.blocks = Gauge(
            "cachehit_router_kv_index_blocks",
            "Blocks the router's index holds for the engine, by medium (gpu, cpu: its CPU/offload tier)",
            ["backend", "medium"],
            registry=r,
        )
        self.orphans = Gauge(
            "cachehit_router_kv_index_orphans",
            "Stored blocks not indexed because their parent was unknown (stream joined late)",
            ["backend"],
            registry=r,
        )

        self.others_sequences = Gauge(
            "cachehit_router_kv_events_others_sequences",
            "Sequences begun on the engine that this router did not send, as its KV events show them "
            "(other replicas', clients that bypass the router)",
            ["backend"],
            registry=r,
        )
        self.block_seconds = Gauge(
            "cachehit_router_kv_events_block_seconds",
            "Measured time between two decoded blocks of one sequence (a running sequence's window is twice it)",
            ["backend"],
            registry=r,
        )

    def bind(
        self, st: KvStreamGauges, index: KvIndexGauges, fresh: Callable[[], bool], sequences: SequenceGauges
    ) -> None:
        name = st.name
        self.lag.labels(name).set_function(lambda: st.lag_s)
        self.fresh.labels(name).set_function(lambda: 1 if fresh() else 0)
        self.gaps.labels(name).set_function(lambda: st.gaps)
        self.replays.labels(name).set_function(lambda: st.replays)
        self.restarts.labels(name).set_function(lambda: st.restarts)
        self.decode_errors.labels(name).set_function(lambda: st.decode_errors)
        self.blocks.labels(name, "gpu").set_function(lambda: index.stats(name).gpu_blocks)
        self.blocks.labels(name, "cpu").set_function(lambda: index.stats(name).cpu_blocks)
        self.orphans.labels(name).set_function(lambda: index.stats(name).orphans)
        self.others_sequences.labels(name).set_function(lambda: sequences.began_others)
        self.block_seconds.labels(name).set_function(lambda: sequences.block_s)

    def unbind(self, name: str) -> None:
        for medium in ("gpu", "cpu"):
            with contextlib.suppress(KeyError):
                self.blocks.remove(name, medium)
        gauges = (self.lag, self.fresh, self.gaps, self.replays, self.restarts, self.decode_errors, self.orphans)
        for gauge in (*gauges, self.others_sequences, self.block_seconds):
            with contextlib.suppress(KeyError):
                gauge.remove(name)
