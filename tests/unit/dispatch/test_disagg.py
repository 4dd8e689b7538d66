"""The NIXL prefill/decode protocol (router/dispatch/disagg.py): the producer's answer and
when a failed decode recomputes the prompt."""

from __future__ import annotations

import pytest

from router.dispatch.disagg import PrefillProtocolError, parse_prefill_response, recompute_after_failed_decode
from router.engine.errors import BROKEN, CONNECT, ENGINE_ERROR, FIRST_TOKEN_TIMEOUT, STATUS, UpstreamError


def test_prefill_response_parsing() -> None:
    params = parse_prefill_response(
        {"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e"}, "usage": {"prompt_tokens": 526}}
    )
    assert params == {"do_remote_prefill": True, "remote_engine_id": "e"}
    with pytest.raises(PrefillProtocolError):
        parse_prefill_response({"kv_transfer_params": None})


@pytest.mark.parametrize(
    ("error", "recompute"),
    [
        (None, False),
        # vLLM's answer to a failed KV load (kv_load_failure_policy "fail"): alive, so recompute.
        (UpstreamError("d", ENGINE_ERROR, "Internal server error"), True),
        (UpstreamError("d", STATUS, "Internal server error", status=500), True),
        (UpstreamError("d", STATUS, "Service Unavailable", status=503), True),
        # The engine refused the request itself: it would refuse it again.
        (UpstreamError("d", STATUS, "bad", status=400), False),
        # Nothing says the transfer failed: retry elsewhere as usual.
        (UpstreamError("d", CONNECT, "refused"), False),
        (UpstreamError("d", FIRST_TOKEN_TIMEOUT, "slow"), False),
        (UpstreamError("d", BROKEN, "reset"), False),
    ],
)
def test_recompute_after_failed_decode(error: UpstreamError, recompute: bool) -> None:
    assert recompute_after_failed_decode(error) is recompute
