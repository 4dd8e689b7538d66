"""Fixtures of the integration suite: a router in this test's event loop in front of
simulated engines (`make_cluster`, support/cluster.py) and a real DNS server for discovery
(`dns_server`, support/dns_server.py)."""

from __future__ import annotations

# Fixtures are found by the name a test asks for: imported under their own name (an explicit
# re-export, which the linter keeps) so that this directory's tests see them.
from support.cluster import make_cluster as make_cluster
from support.dns_server import dns_server as dns_server
