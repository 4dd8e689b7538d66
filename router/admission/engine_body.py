"""A client's JSON body as an engine may see it: the one place every route passes through.

Fields the router owns are removed from what the client sent, on every route that
carries a JSON body to an engine (the generation routes at admission, router/admission/spec.py;
vLLM's other routes before they are forwarded, router/server/forward.py):

- `kv_transfer_params`, `ec_transfer_params`: vLLM 0.32 copies them into the sampling
  parameters of chat, completions and Responses API requests (`ResponsesRequest`
  included), and its engine core reads them from any request's `extra_args`, which is the
  body's `vllm_xargs`: a client naming a host there would make a decode engine pull KV
  cache over NIXL from it. Only a producer engine's own answer is ever forwarded, and only
  to a configured consumer (router/engine/wire.py).
- `cache_hit_threshold`: the router sets each leg's threshold itself.

All three are removed at the top level and inside `vllm_xargs` (an object left empty is
removed too). A body with none of them is sent as the client's own bytes; only a body
that lost a field is serialised again.

The body's `priority` (vLLM's scheduling priority: lower is served earlier, by engines
run with `--scheduling-policy priority`) follows the key's rule for X-Request-Priority
(router/admission/tenants.py), whose scale is the other way round: a key may ask for
`priority` >= -max_priority. An earlier place, or a value that is not an integer, is a 400
naming `priority` (vLLM users get an error for a priority the engine cannot honour, not a
silently different schedule).
"""

from __future__ import annotations

from typing import Any

import orjson

from router.admission.tenants import Tenant
from router.errors import RouterError

# Owned by the router on every route, at the top level and inside `vllm_xargs`.
ENGINE_OWNED = ("kv_transfer_params", "ec_transfer_params", "cache_hit_threshold")
XARGS = "vllm_xargs"
PRIORITY = "priority"


def strip_router_fields(body: dict[str, Any]) -> bool:
    """Remove the router's fields from `body` in place; whether anything was removed."""
    stripped = False
    for key in ENGINE_OWNED:
        if key in body:
            del body[key]
            stripped = True
    xargs = body.get(XARGS)
    if isinstance(xargs, dict) and any(key in xargs for key in ENGINE_OWNED):
        rest = {k: v for k, v in xargs.items() if k not in ENGINE_OWNED}
        if rest:
            body[XARGS] = rest
        else:
            del body[XARGS]
        stripped = True
    return stripped


def check_priority(body: dict[str, Any], tenant: Tenant) -> None:
    """400 naming `priority` for a body priority the tenant may not ask for."""
    prio = body.get(PRIORITY)
    if prio is None:
        return
    # vLLM's pydantic layer would coerce "-100" or -100.0 to an integer: only a JSON
    # integer is checked and passed on.
    if type(prio) is not int:
        raise RouterError(400, "`priority` must be an integer.", param=PRIORITY)
    if prio < -tenant.max_priority:
        raise RouterError(
            400,
            f"`priority` must be at least {-tenant.max_priority} for this API key (lower is served earlier; "
            f"the key's tenants.max_priority is {tenant.max_priority}), got {prio}.",
            param=PRIORITY,
        )


def engine_json(raw: bytes, body: dict[str, Any], tenant: Tenant) -> bytes:
    """What is sent to an engine for the client's JSON body `raw` (parsed as `body`, which
    is changed in place): `raw` itself unless a router field had to be removed."""
    check_priority(body, tenant)
    if not strip_router_fields(body):
        return raw
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError as e:  # nested deeper than orjson writes (254 levels)
        raise RouterError(400, f"The request body cannot be forwarded: {e}", param=None) from None
