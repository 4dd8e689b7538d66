"""Data-parallel ranks as engines: a backend that declares `data_parallel_size = N` (one
vLLM server started with `--data-parallel-size N`: N engine cores, N KV caches, one API
address) becomes N backends, one per rank, so each rank is probed, placed and
load-modelled on its own. A request reaches a rank through vLLM's `X-data-parallel-rank`
header (vllm/entrypoints: `_get_data_parallel_rank`); each rank publishes its KV events on
the configured ports plus its rank, as vLLM offsets them (`offset_endpoint_port`).
"""

from __future__ import annotations

import dataclasses

from router.config.schema import BackendConfig

# vLLM 0.32 reads the rank of a generation request from this header.
DP_RANK_HEADER = "X-data-parallel-rank"


def rank_name(name: str, rank: int) -> str:
    """The backend name of one rank of `name`."""
    return f"{name}-dp{rank}"


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's per-rank event endpoint: a tcp port plus the rank (port 0 stays 0); an
    ipc:// or inproc:// path with a `_dp<rank>` suffix; rank 0 unchanged."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit() and int(port) != 0:
        return f"{base}:{int(port) + rank}"
    return endpoint


def expand_ranks(backend: BackendConfig) -> list[BackendConfig]:
    """One backend per DP rank (itself when it declares one rank or is a rank already)."""
    n = backend.data_parallel_size
    if n <= 1 or backend.data_parallel_rank >= 0:
        return [backend]
    return [
        dataclasses.replace(
            backend,
            name=rank_name(backend.name, r),
            data_parallel_rank=r,
            kv_events_endpoint=offset_endpoint(backend.kv_events_endpoint, r),
            kv_events_replay_endpoint=offset_endpoint(backend.kv_events_replay_endpoint, r),
        )
        for r in range(n)
    ]


def rank_headers(backend: BackendConfig) -> dict[str, str]:
    """The headers that target `backend`'s rank (none for a backend without one)."""
    return {DP_RANK_HEADER: str(backend.data_parallel_rank)} if backend.data_parallel_rank >= 0 else {}
