"""DP ranks as backends (router/config/data_parallel.py): the expansion of
`backends[].data_parallel_size`, the rank header, vLLM's per-rank event endpoints."""

from __future__ import annotations

from typing import Any

import pytest

from router.config.data_parallel import DP_RANK_HEADER, expand_ranks, offset_endpoint, rank_headers
from router.config.parse import parse_config
from router.config.schema import BackendConfig, ConfigError


def _config(**backend: Any) -> Any:
    return parse_config({"backends": [{"name": "a", "url": "http://10.0.0.1:8000", **backend}]})


def test_a_backend_with_ranks_is_one_backend_per_rank() -> None:
    cfg = _config(
        data_parallel_size=3,
        kv_events_endpoint="tcp://10.0.0.1:5557",
        kv_events_replay_endpoint="tcp://10.0.0.1:5657",
    )
    assert [(b.name, b.data_parallel_rank) for b in cfg.backends] == [("a-dp0", 0), ("a-dp1", 1), ("a-dp2", 2)]
    assert {b.url for b in cfg.backends} == {"http://10.0.0.1:8000"}
    # Each rank publishes on the configured ports plus its rank, as vLLM offsets them.
    assert [b.kv_events_endpoint for b in cfg.backends] == [f"tcp://10.0.0.1:{p}" for p in (5557, 5558, 5559)]
    assert [b.kv_events_replay_endpoint for b in cfg.backends] == [f"tcp://10.0.0.1:{p}" for p in (5657, 5658, 5659)]
    assert [rank_headers(b) for b in cfg.backends] == [{DP_RANK_HEADER: str(r)} for r in range(3)]


def test_one_rank_is_the_backend_itself_without_a_rank_header() -> None:
    (b,) = _config().backends
    assert b.name == "a"
    assert rank_headers(b) == {}
    assert expand_ranks(b) == [b]


def test_a_declared_rank_targets_that_rank_alone() -> None:
    (b,) = _config(data_parallel_size=4, data_parallel_rank=2).backends
    assert (b.name, rank_headers(b)) == ("a", {DP_RANK_HEADER: "2"})


@pytest.mark.parametrize(
    ("fields", "key"),
    [({"data_parallel_size": 0}, "data_parallel_size"), ({"data_parallel_rank": 1}, "data_parallel_rank")],
)
def test_wrong_sizes_and_ranks_are_named(fields: dict[str, int], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"backends\[0\]\.{key}"):
        _config(**fields)


def test_event_endpoints_are_offset_as_vllm_offsets_them() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("ipc:///run/ev", 1) == "ipc:///run/ev_dp1"
    assert offset_endpoint("", 1) == ""


def test_the_expansion_keeps_every_other_field() -> None:
    b = BackendConfig(name="x", url="http://h:1", models=("m",), api_key="k", data_parallel_size=2)
    ranks = expand_ranks(b)
    assert [(r.models, r.api_key, r.data_parallel_size) for r in ranks] == [(("m",), "k", 2)] * 2
