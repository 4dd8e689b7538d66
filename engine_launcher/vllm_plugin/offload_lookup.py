"""The KV connector's tokens for a request, computed without side effects (arrival check).

vLLM's `get_num_new_matched_tokens` is only called at admission: for the OffloadingConnector
it mutates the request's offload state, records lookup stats and events and may start
asynchronous lookups, so the arrival check must not call it. What each connector gives here:

- NIXL (`NixlBaseConnector`): a decode leg's (`do_remote_prefill`) remote tokens, which its
  `get_num_new_matched_tokens` derives from the prompt length without side effects; 0 for
  any other request.
- OffloadingConnector with vLLM's CPU backend (`CPUOffloadingManager`, whose `lookup` is a
  dictionary read): the run of stored chunks that follows the local hit, capped at the
  request's length, exactly as `_lookup_complete_chunks` counts for a single full-attention
  group (`vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`). A chunk
  still being stored (`HIT_PENDING`) or a backend that defers (`RETRY`) makes the answer
  unknown (None), as it makes vLLM defer the request.
- MultiConnector: the first child offering tokens, in configuration order (vLLM's rule).
- anything else (other connectors, sliding-window or hybrid models, other offload backends):
  None, unknown; the arrival check then rejects nothing and admission decides.
"""

from __future__ import annotations

from typing import Any


def external_tokens(connector: Any, request: Any, num_local: int) -> int | None:
    """Tokens the connector would load beyond `num_local` (block-aligned), or None."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    if isinstance(connector, MultiConnector):
        for child in connector.sub_connectors:
            tokens = external_tokens(child, request, num_local)
            if tokens is None or tokens > 0:
                return tokens
        return 0
    if isinstance(connector, NixlBaseConnector):
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0  # NIXL loads nothing for a request that is not a decode leg
        tokens, _ = connector.get_num_new_matched_tokens(request, num_local)
        return tokens
    if isinstance(connector, OffloadingConnector):
        return _cpu_tier_tokens(connector.scheduler, request, num_local)
    return None


def _cpu_tier_tokens(sched: Any, request: Any, num_local: int) -> int | None:
    from vllm.v1.kv_offload.base import LookupResult, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    groups = sched.config.kv_group_configs
    if (
        not isinstance(sched.manager, CPUOffloadingManager)
        or len(groups) != 1
        or groups[0].sliding_window_size_in_chunks is not None
        or groups[0].is_eagle_group
    ):
        return None
    if request.skip_reading_prefix_cache:
        return 0
    state = sched._req_status.get(request.request_id)
    if state is None:
        return None
    group = groups[0]
    per_chunk = group.tokens_per_chunk
    hashes = request.block_hashes
    num_chunks = len(hashes) // group.hashes_per_chunk
    max_tokens = min(request.num_tokens, num_chunks * per_chunk)
    start = num_local // per_chunk
    hits = 0
    for chunk in range(start, max_tokens // per_chunk):
        key = make_offload_key(hashes[(chunk + 1) * group.hashes_per_chunk - 1], group.group_idx)
        result = sched.manager.lookup(key, state.req_context)
        if result is LookupResult.MISS:
            break
        if result is not LookupResult.HIT:
            return None
        hits += 1
    tokens = (start + hits) * per_chunk - num_local
    return tokens if tokens >= per_chunk else 0
