"""Keys name the tenant; the priority header follows the tenant's rule."""

from __future__ import annotations

import pytest

from router.admission.auth import KeyRing, request_priority
from router.admission.tenants import Tenant
from router.config.schema import TenantConfig
from router.errors import RouterError


def _known(tenant: Tenant | None) -> Tenant:
    assert tenant is not None  # the key is on the ring
    return tenant


def _ring() -> KeyRing:
    return KeyRing(("plain-key",), (TenantConfig(name="batch", api_key="batch-key", max_priority=2),), "admin-key")


def test_each_key_names_its_tenant_and_nothing_else_does() -> None:
    ring = _ring()
    assert ring.required
    assert ring.has_admin
    assert _known(ring.tenant_of({"Authorization": "Bearer batch-key"})).name == "batch"
    assert _known(ring.tenant_of({"Authorization": "bearer  plain-key "})).name.startswith("key-")
    assert "plain-key" not in _known(ring.tenant_of({"Authorization": "Bearer plain-key"})).name
    for headers in (
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": "Basic batch-key"},
        {"Authorization": "Bearer admin-key"},
        {"Authorization": "batch-key"},
    ):
        assert ring.tenant_of(headers) is None, headers
    assert ring.is_admin({"Authorization": "Bearer admin-key"})
    assert not ring.is_admin({"Authorization": "Bearer batch-key"})
    assert not KeyRing((), (), "").required


@pytest.mark.parametrize(("value", "status"), [("3", 403), ("101", 400), ("high", 400), ("", 400), ("1.5", 400)])
def test_priority_header_outside_the_rule_is_refused(value: str, status: int) -> None:
    with pytest.raises(RouterError) as e:
        request_priority({"X-Request-Priority": value}, Tenant("batch", max_priority=2))
    assert e.value.status == status
    assert "X-Request-Priority" in e.value.message


def test_priority_header_within_the_rule() -> None:
    t = Tenant("batch", max_priority=2)
    assert request_priority({}, t) == 0
    assert [request_priority({"X-Request-Priority": v}, t) for v in ("2", " 1 ", "-100")] == [2, 1, -100]


def _status(refused: RouterError | None) -> int | None:
    return None if refused is None else refused.status


def test_admin_routes_are_missing_without_an_admin_key_and_closed_to_other_keys() -> None:
    ring = _ring()
    assert ring.admin_refusal({"Authorization": "Bearer admin-key"}) is None
    assert _status(ring.admin_refusal({"Authorization": "Bearer batch-key"})) == 401
    assert _status(ring.admin_refusal({})) == 401
    assert _status(KeyRing(("plain-key",), (), "").admin_refusal({"Authorization": "Bearer plain-key"})) == 404
