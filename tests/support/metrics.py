"""Prometheus text exposition (the router's and the engines' /metrics) read with
prometheus_client's own parser."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class Metrics:
    """The samples of one scrape."""

    samples: tuple[Sample, ...]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels` (so a test
        need not name every label, e.g. `model`); 0.0 when there is none."""
        return sum(
            (s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())),
            0.0,
        )

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def parse_metrics(text: str) -> Metrics:
    return Metrics(tuple(s for family in text_string_to_metric_families(text) for s in family.samples))


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str) -> Metrics:
    """GET base_url + /metrics, parsed."""
    async with session.get(base_url + "/metrics") as r:
        assert r.status == 200, f"{base_url}/metrics answered {r.status}"
        return parse_metrics(await r.text())
