"""Prometheus text exposition (the router's and the engines' /metrics) read with
prometheus_client's own parser.

A read of a metric the exposition does not declare at all fails the test (AssertionError
naming it): after a rename, `value(...) == 0` must not pass by reading nothing. `value`
also fails when no sample carries the labels asked for; `sample_or_zero` reads 0 there,
for a labelled family that has not seen that label set (yet), which is what a test means
by "none happened".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

# The sample names a family may expose besides its own name (counters, summaries,
# histograms, gauge histograms, info).
_SUFFIXES = ("", "_total", "_created", "_count", "_sum", "_bucket", "_gcount", "_gsum", "_info")


@dataclass(frozen=True)
class Metrics:
    """The samples of one scrape, and the families it declared (with or without samples)."""

    samples: tuple[Sample, ...]
    families: frozenset[str] = frozenset()

    def has(self, name: str) -> bool:
        """Whether the exposition declares `name` (a sample name or its family's)."""
        return name in self.names() or any(name == f + s for f in self.families for s in _SUFFIXES)

    def _matching(self, name: str, labels: dict[str, str]) -> list[Sample]:
        if not self.has(name):
            known = sorted(n for n in self.names() | self.families if n.split("_")[0] == name.split("_")[0])
            raise AssertionError(f"metric {name!r} is not in the exposition (similar: {known[:20]})")
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels` (so a test
        need not name every label, e.g. `model`). Fails when there is no such sample."""
        found = self._matching(name, labels)
        if not found:
            seen = sorted(str(s.labels) for s in self.samples if s.name == name)
            raise AssertionError(f"metric {name!r} has no sample labelled {labels} (label sets: {seen[:20]})")
        return sum((s.value for s in found), 0.0)

    def sample_or_zero(self, name: str, **labels: str) -> float:
        """`value`, but 0.0 when the declared metric has no sample with these labels."""
        return sum((s.value for s in self._matching(name, labels)), 0.0)

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def _metrics(families: Iterable[Metric]) -> Metrics:
    families = list(families)
    return Metrics(tuple(s for f in families for s in f.samples), frozenset(f.name for f in families))


def parse_metrics(text: str) -> Metrics:
    return _metrics(text_string_to_metric_families(text))


def registry_metrics(registry: Collector) -> Metrics:
    """A prometheus_client registry read in-process, as a scrape would read it."""
    return _metrics(registry.collect())


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str) -> Metrics:
    """GET base_url + /metrics, parsed."""
    async with session.get(base_url + "/metrics") as r:
        assert r.status == 200, f"{base_url}/metrics answered {r.status}"
        return parse_metrics(await r.text())
