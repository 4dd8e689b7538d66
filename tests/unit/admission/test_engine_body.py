"""A client's JSON body as an engine gets it (router/admission/engine_body.py): the router's
fields removed at the top level and inside vllm_xargs, the client's bytes kept when
nothing was removed, and the body's `priority` held to the key's max_priority."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.admission.engine_body import ENGINE_OWNED, check_priority, engine_json, strip_router_fields
from router.admission.tenants import Tenant
from router.errors import RouterError

HOSTILE: dict[str, Any] = {
    "model": "m",
    "input": "hello",
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 5600},
    "ec_transfer_params": {"x": 1},
    "cache_hit_threshold": 0.5,
    "vllm_xargs": {"kv_transfer_params": "x", "ec_transfer_params": "y", "cache_hit_threshold": 1, "keep": 3},
}


def _send(body: dict[str, Any], tenant: Tenant | None = None) -> bytes:
    raw = orjson.dumps(body)
    return engine_json(raw, orjson.loads(raw), tenant or Tenant("t"))


def test_router_fields_are_removed_at_the_top_level_and_in_vllm_xargs() -> None:
    sent = orjson.loads(_send(HOSTILE))
    assert sent == {"model": "m", "input": "hello", "vllm_xargs": {"keep": 3}}
    for key in ENGINE_OWNED:
        assert key in HOSTILE
        assert key in HOSTILE["vllm_xargs"]


def test_vllm_xargs_left_empty_is_removed() -> None:
    body = {"model": "m", "vllm_xargs": {"kv_transfer_params": "x"}}
    assert strip_router_fields(body) is True
    assert body == {"model": "m"}


def test_a_clean_body_is_sent_as_the_clients_own_bytes() -> None:
    raw = b'{"model":"m",  "input":"a", "vllm_xargs": {"k": 1}, "priority": 3, "request_id": "r"}'
    assert engine_json(raw, orjson.loads(raw), Tenant("t")) is raw
    body = {"model": "m", "vllm_xargs": "not an object"}  # vLLM's to refuse
    assert strip_router_fields(body) is False


@pytest.mark.parametrize(("max_priority", "priority"), [(0, 0), (0, 5), (0, 10**6), (10, -10), (100, -100)])
def test_a_priority_within_the_keys_rule_passes(max_priority: int, priority: int) -> None:
    check_priority({"priority": priority}, Tenant("t", max_priority=max_priority))


@pytest.mark.parametrize(("max_priority", "priority"), [(0, -1), (0, -100), (10, -11), (-5, 0), (-5, 4)])
def test_an_earlier_priority_than_the_key_may_ask_is_a_400_naming_priority(max_priority: int, priority: int) -> None:
    with pytest.raises(RouterError) as e:
        _send({"model": "m", "priority": priority}, Tenant("t", max_priority=max_priority))
    assert e.value.status == 400
    assert e.value.param == "priority"
    assert "max_priority" in e.value.message


@pytest.mark.parametrize("priority", ["-100", -100.0, True, [1], {"a": 1}])
def test_a_priority_that_is_not_a_json_integer_is_a_400(priority: object) -> None:
    with pytest.raises(RouterError) as e:
        check_priority({"priority": priority}, Tenant("t", max_priority=100))
    assert (e.value.status, e.value.param) == (400, "priority")


def test_no_priority_or_null_is_left_to_the_engine() -> None:
    check_priority({}, Tenant("t"))
    check_priority({"priority": None}, Tenant("t"))
