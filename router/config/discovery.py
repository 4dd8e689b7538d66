"""`[[discovery]]` tables: where the router finds engines at run time (docs/CONFIG.md).

kind "dns": every address a DNS name resolves to (A and AAAA records: a Kubernetes
headless Service, a Consul or Compose service name) is an engine on `port`.
kind "kubernetes": every ready pod matching `label_selector` in `namespace`, read from the
Kubernetes API (the `kubernetes` extra is not needed: plain HTTP with the pod's
service-account token).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from router.config.checks import Problems, build_table, check_one_of, check_port, check_positive, check_url, str_list
from router.config.kv_events import check_discovery_kv_events
from router.config.schema import ConfigError, DiscoveryConfig
from router.names import Role

KINDS = ("dns", "kubernetes")


def parse_nameserver(key: str, value: str) -> tuple[str, int]:
    """ "10.0.0.2", "10.0.0.2:5353", "::1", "[::1]:5353" -> (address, port)."""
    host, port = value, 53
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise ConfigError(f"{key}: expected an IP address with an optional :port, got {value!r}")
            port = int(rest[1:])
    elif value.count(":") == 1:
        host, _, p = value.partition(":")
        if not p.isdigit():
            raise ConfigError(f"{key}: expected an IP address with an optional :port, got {value!r}")
        port = int(p)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"{key}: expected an IP address with an optional :port, got {value!r}") from None
    check_port(key, port, allow_zero=False)
    return host, port


def parse_discovery(p: Problems, raw: Any) -> tuple[DiscoveryConfig, ...]:
    if not isinstance(raw, list):
        p.add("discovery: expected an array of tables ([[discovery]])")
        return ()
    out = []
    for i, rd in enumerate(raw):
        key = f"discovery[{i}]"
        d = build_table(p, DiscoveryConfig, key, rd, {"models": str_list, "nameservers": str_list})
        if d is None:
            continue
        if d.kind not in KINDS:
            p.add(f"{key}.kind: expected one of {', '.join(KINDS)}, got {d.kind!r}")
        elif d.kind == "dns" and not d.name:
            p.add(f"{key}.name: required for kind 'dns' (the DNS name to resolve)")
        elif d.kind == "kubernetes" and not d.label_selector:
            p.add(f"{key}.label_selector: required for kind 'kubernetes' (for example 'app=vllm-decode')")
        p.check(check_one_of, f"{key}.role", d.role, Role)
        if d.scheme not in ("http", "https"):
            p.add(f"{key}.scheme: expected 'http' or 'https', got {d.scheme!r}")
        p.check(check_port, f"{key}.port", d.port, allow_zero=False)
        p.check(check_positive, f"{key}.interval_s", d.interval_s)
        for j, ns in enumerate(d.nameservers):
            p.check(parse_nameserver, f"{key}.nameservers[{j}]", ns)
        if d.api_server:
            p.check(check_url, f"{key}.api_server", d.api_server)
        check_discovery_kv_events(p, key, d)
        out.append(d)
    sources = [d.source for d in out]
    for s in sorted({s for s in sources if sources.count(s) > 1}):
        p.add(f"discovery: two tables look up the same {s.split(':', 2)[2]!r}")
    return tuple(out)
