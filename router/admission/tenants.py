"""Tenants: per-API-key limits and priorities, so that one client cannot starve the others.

A tenant is one client key with its own limits, from `[[tenants]]` in router.toml (the key
itself in the file or, better, in an environment variable named by `api_key_env`). Keys
listed in `server.api_keys` are tenants without limits of their own, named
`key-<first 8 hex digits of the key's SHA-256>`; without any key, every request belongs
to the tenant `anonymous`. The name labels the tenant's metrics and log lines: never the
secret.

What the limits mean (enforced by the admission queue, router/admission/limiter.py):
- `requests_per_s` / `burst`: a token bucket; a request over it gets 429 at once, with
  Retry-After when the next one would pass.
- `max_concurrent_requests`: the tenant's requests executing at once; more wait in the
  queue (at most `max_queued_requests` of them, then 429).
- `max_priority`: the highest `X-Request-Priority` the key may send (default 0; any
  lower value, down to -100, is always allowed). The queue serves the highest priority
  first, then the tenant with the fewest requests executing, then the oldest request.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from router.config.schema import MAX_PRIORITY, MIN_PRIORITY, TenantConfig

PRIORITY_HEADER = "X-Request-Priority"
ANONYMOUS = "anonymous"


def key_name(key: str) -> str:
    """The metric name of a key listed in server.api_keys: a short digest, not the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


class TokenBucket:
    """`rate` requests per second on average, `burst` at once."""

    __slots__ = ("_t", "_tokens", "burst", "rate")

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self._tokens = float(burst)
        self._t: float | None = None

    def take(self, now: float) -> float:
        """Take one request's token: 0.0, or the seconds until one is there (none taken)."""
        if self._t is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        self._t = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate


class Tenant:
    """One tenant's limits and what it holds now (counted by the limiter)."""

    __slots__ = ("active", "bucket", "max_concurrent", "max_priority", "max_queued", "name", "queued")

    def __init__(
        self,
        name: str,
        *,
        max_concurrent: int = 0,
        max_queued: int = 0,
        requests_per_s: float = 0.0,
        burst: int = 0,
        max_priority: int = 0,
    ):
        self.name = name
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued or max_concurrent
        self.bucket = (
            TokenBucket(requests_per_s, burst or max(1, math.ceil(requests_per_s))) if requests_per_s > 0 else None
        )
        self.max_priority = max_priority
        self.active = 0
        self.queued = 0

    @classmethod
    def from_config(cls, t: TenantConfig) -> Tenant:
        return cls(
            t.name,
            max_concurrent=t.max_concurrent_requests,
            max_queued=t.max_queued_requests,
            requests_per_s=t.requests_per_s,
            burst=t.burst,
            max_priority=t.max_priority,
        )

    def may_start(self) -> bool:
        return not self.max_concurrent or self.active < self.max_concurrent

    def may_queue(self) -> bool:
        return not self.max_queued or self.queued < self.max_queued


def build_tenants(api_keys: tuple[str, ...], tenants: tuple[TenantConfig, ...]) -> dict[str, Tenant]:
    """Key -> tenant, for every client key (the keys are the caller's to digest)."""
    out = {k: Tenant(key_name(k)) for k in api_keys}
    for t in tenants:
        out[t.api_key] = Tenant.from_config(t)
    return out


def parse_priority(headers: Any, tenant: Tenant) -> int:
    """The request's priority from its X-Request-Priority header (0 without one).
    Raises ValueError (400) for a value that is not an integer in range, PermissionError
    (403) for one above what the tenant's key is allowed."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return 0
    try:
        prio = int(raw.strip(), 10)
    except ValueError:
        prio = None
    if prio is None or not MIN_PRIORITY <= prio <= MAX_PRIORITY:
        raise ValueError(f"{PRIORITY_HEADER}: expected an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
    if prio > tenant.max_priority:
        raise PermissionError(
            f"{PRIORITY_HEADER}: this API key may ask for a priority of at most "
            f"{tenant.max_priority} (tenants.max_priority), got {prio}"
        )
    return prio
