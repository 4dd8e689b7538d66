"""Engines found at run time: one loop per `[[discovery]]` table.

Each round looks the engines up (a DNS name's addresses, or the ready pods of a label
selector) and hands the fleet the backends it wants (`Fleet.reconcile`): a new address
joins once its health check passes, one that vanished is drained and removed. A look-up
that fails (a DNS timeout, the API server unreachable) changes nothing: an outage of the
directory is not an outage of the engines. "No such name" (NXDOMAIN, no records) is an
answer: zero engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from router.config.discovery import parse_nameserver
from router.config.schema import BackendConfig, DiscoveryConfig
from router.fleet.kubernetes import KubernetesLookup
from router.fleet.lookup import Lookup, LookupFailed, backend_for
from router.fleet.membership import Fleet

log = logging.getLogger("cachehit_router.discovery")

# The DNS look-up's own time limit, well under any sensible interval.
_DNS_LIFETIME_S = 3.0


class DnsLookup:
    def __init__(self, d: DiscoveryConfig):
        self.d = d
        self.resolver = dns.asyncresolver.Resolver(configure=not d.nameservers)
        if d.nameservers:
            self.resolver.nameservers = [
                dns.nameserver.Do53Nameserver(*parse_nameserver("nameservers", ns)) for ns in d.nameservers
            ]
        self.resolver.cache = None  # every round asks: the point is to see changes

    async def __call__(self) -> dict[str, BackendConfig]:
        addresses: list[str] = []
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(self.d.name, rdtype, lifetime=_DNS_LIFETIME_S, search=False)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue  # an answer: no such records
            except dns.exception.DNSException as e:  # half an answer is no answer
                raise LookupFailed(f"{self.d.name} {rdtype}: {type(e).__name__}: {e}") from None
            addresses += [r.address for r in answer]
        ordered = sorted(set(addresses), key=ipaddress.ip_address)
        return {b.name: b for b in (backend_for(self.d, a, self.d.name) for a in ordered)}


def make_lookup(d: DiscoveryConfig) -> Lookup:
    if d.kind == "kubernetes":
        return KubernetesLookup(d)
    return DnsLookup(d)


class Discovery:
    """The loops of every `[[discovery]]` table, feeding one fleet."""

    def __init__(
        self,
        fleet: Fleet,
        tables: tuple[DiscoveryConfig, ...],
        lookup_factory: Callable[[DiscoveryConfig], Lookup] = make_lookup,
    ):
        self.fleet = fleet
        self.tables = tables
        self.lookup_factory = lookup_factory
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self.rounds: dict[str, int] = {}  # source -> look-ups that answered
        self.failures: dict[str, int] = {}  # source -> look-ups that did not

    async def start(self) -> None:
        """One round of every table before serving (as the first health round), then loops."""
        lookups = {d.source: (d, self.lookup_factory(d)) for d in self.tables}
        await asyncio.gather(*(self.round(d, lk) for d, lk in lookups.values()))
        for source, (d, lk) in lookups.items():
            self._tasks[source] = asyncio.create_task(self._run(d, lk), name=source)

    async def round(self, d: DiscoveryConfig, lookup: Lookup) -> None:
        try:
            wanted = await lookup()
        except Exception as e:
            self.failures[d.source] = self.failures.get(d.source, 0) + 1
            if isinstance(e, (LookupFailed, OSError, asyncio.TimeoutError)):
                log.warning("%s: look-up failed, engines kept as they are: %s", d.source, e)
            else:  # a bug or a malformed answer: same, with the traceback
                log.exception("%s: look-up failed, engines kept as they are", d.source)
            return
        self.rounds[d.source] = self.rounds.get(d.source, 0) + 1
        await self.fleet.reconcile(d.source, wanted, check_first=True)

    async def _run(self, d: DiscoveryConfig, lookup: Lookup) -> None:
        while True:
            await asyncio.sleep(d.interval_s)
            try:
                await self.round(d, lookup)
            except Exception:  # never let a loop die
                log.exception("%s: discovery round failed", d.source)

    async def stop(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        for t in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()

    async def replace(self, tables: tuple[DiscoveryConfig, ...]) -> None:
        """After a reload: restart the loops; the backends of a table that is gone are
        drained and removed, those of a table that stayed are kept."""
        await self.stop()
        gone = {d.source for d in self.tables} - {d.source for d in tables}
        self.tables = tables
        for source in gone:
            await self.fleet.reconcile(source, {})
        await self.start()
