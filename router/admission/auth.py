"""Client and admin keys: who a request is, compared in constant time.

Keys are kept as SHA-256 digests, computed once; a request's bearer token is digested
and compared with every key without an early exit, so the time taken says nothing of
which key matched or of the keys' lengths. Each client key is a tenant
(router/admission/tenants.py): its limits, its priority rule, its metrics.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from router import errors
from router.admission.tenants import Tenant, build_tenants, parse_priority
from router.config.schema import TenantConfig


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def bearer_digest(headers: Mapping[str, str]) -> bytes | None:
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 9110 11.1)
        return None
    # Header bytes that are not UTF-8 arrive surrogate-escaped: compare them as bytes.
    return _digest(token.strip().encode("utf-8", "surrogateescape"))


class KeyRing:
    def __init__(self, api_keys: tuple[str, ...], tenants: tuple[TenantConfig, ...], admin_key: str):
        self._tenants = tuple((_digest(k.encode()), t) for k, t in build_tenants(api_keys, tenants).items())
        self._admin = _digest(admin_key.encode()) if admin_key else None

    def keeping(self, old: KeyRing) -> KeyRing:
        """This ring with `old`'s Tenant objects where the names match (a reload): a tenant's
        running requests, queue and rate budget carry over."""
        by_name = {t.name: t for t in old.tenants}
        self._tenants = tuple((d, by_name.get(t.name, t)) for d, t in self._tenants)
        return self

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        return tuple(t for _, t in self._tenants)

    @property
    def required(self) -> bool:
        """Client keys are configured: /v1/* needs one."""
        return bool(self._tenants)

    @property
    def has_admin(self) -> bool:
        return self._admin is not None

    def tenant_of(self, headers: Mapping[str, str]) -> Tenant | None:
        """The tenant whose key the request carries; None for a missing or wrong key."""
        given = bearer_digest(headers)
        if given is None:
            return None
        found = None
        for digest, t in self._tenants:
            if hmac.compare_digest(given, digest):
                found = t
        return found

    def is_admin(self, headers: Mapping[str, str]) -> bool:
        given = bearer_digest(headers)
        return given is not None and self._admin is not None and hmac.compare_digest(given, self._admin)

    def admin_refusal(self, headers: Mapping[str, str]) -> errors.RouterError | None:
        """Why an admin route refuses this request: 404 while no admin key is configured
        (the routes do not exist), 401 for a missing or wrong key; None: admitted."""
        if not self.has_admin:
            return errors.route_not_found()
        if not self.is_admin(headers):
            return errors.unauthorized()
        return None


def request_priority(headers: Mapping[str, str], tenant: Tenant) -> int:
    """X-Request-Priority as the tenant may send it: 400 if malformed, 403 above its
    max_priority."""
    try:
        return parse_priority(headers, tenant)
    except ValueError as e:
        raise errors.RouterError(400, str(e)) from None
    except PermissionError as e:
        raise errors.RouterError(403, str(e)) from None
