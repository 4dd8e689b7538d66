"""The NIXL prefill/decode protocol of vLLM 0.32: the producer's answer and when a failed
decode is computed again.

Prefill leg (producer): the client's body with `max_tokens` 1, non-streaming, and
`kv_transfer_params` asking for a remote decode (`wire.prefill_leg_body`). The producer
computes the prompt's KV cache, holds its blocks under a lease and answers with the
`kv_transfer_params` a consumer needs to pull them (engine id, block ids, host and port of
its side channel), which this module reads. Decode leg (consumer): the client's body plus
those params verbatim, streamed, with the guard threshold (`wire.decode_leg_body`).

Client-supplied `kv_transfer_params` never get here (admission strips them); the params
forwarded to a consumer always come from a configured producer's answer.
"""

from __future__ import annotations

from typing import Any

from router.engine.errors import ENGINE_ERROR, STATUS, UpstreamError
from router.engine.wire import KV_TRANSFER_PARAMS


class PrefillProtocolError(ValueError):
    """The producer's answer lacks usable transfer parameters."""


def parse_prefill_response(resp: dict[str, Any]) -> dict[str, Any]:
    """The producer's `kv_transfer_params`, which the decode leg sends on verbatim."""
    params = resp.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise PrefillProtocolError(
            "the prefill engine returned no kv_transfer_params with do_remote_prefill; is it "
            "started with a kv_producer NixlConnector?"
        )
    return params


def recompute_after_failed_decode(error: UpstreamError | None) -> bool:
    """Whether a decode leg that failed before its first token should run again on the same
    engine without the transferred cache.

    vLLM's default `kv_load_failure_policy = "fail"` ends a request whose NIXL pull failed
    (lease expired, handshake timed out) with an internal error: the engine answered, so it
    is alive, and the prompt can be computed there instead. A connection that failed or
    timed out says nothing about the transfer, so the normal retry elsewhere applies.
    """
    if error is None or error.client_fault:
        return False
    return error.kind == ENGINE_ERROR or (error.kind == STATUS and (error.status or 0) >= 500)
