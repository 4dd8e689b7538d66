"""The threshold rule of the plugin as plain functions (no vLLM needed, runs everywhere)."""

from __future__ import annotations

import math

import pytest

from engine_launcher.vllm_plugin.threshold import (
    PluginConfig,
    ThresholdError,
    below_threshold,
    effective_threshold,
    is_prefill_leg,
    request_threshold,
    validate_threshold,
)


@pytest.mark.parametrize(("value", "expected"), [(None, None), (0, 0.0), (1, 1.0), (0.5, 0.5), (0.0, 0.0), (1.0, 1.0)])
def test_valid_thresholds(value: float | None, expected: float | None) -> None:
    assert validate_threshold(value) == expected


@pytest.mark.parametrize("value", [1.5, -0.1, "0.5", True, False, math.nan, math.inf, [0.5], {"x": 1}])
def test_invalid_thresholds_name_the_field(value: object) -> None:
    with pytest.raises(ThresholdError) as info:
        validate_threshold(value, "vllm_xargs.cache_hit_threshold")
    assert info.value.param == "vllm_xargs.cache_hit_threshold"
    assert "between 0 and 1" in str(info.value)


def test_top_level_wins_but_both_must_be_valid() -> None:
    assert request_threshold(0.9, {"cache_hit_threshold": 0.1}) == 0.9
    assert request_threshold(None, {"cache_hit_threshold": 0.1}) == 0.1
    assert request_threshold(None, {"other": 3}) is None
    assert request_threshold(None, None) is None
    with pytest.raises(ThresholdError) as info:
        request_threshold(0.5, {"cache_hit_threshold": 2})
    assert info.value.param == "vllm_xargs.cache_hit_threshold"


def test_engine_config_from_additional_config() -> None:
    assert PluginConfig.from_additional_config({}) == PluginConfig(0.0, True)
    assert PluginConfig.from_additional_config(None) == PluginConfig(0.0, True)
    cfg = PluginConfig.from_additional_config(
        {"global_cache_hit_threshold": 0.4, "cache_hit_arrival_check": False, "other": 1}
    )
    assert cfg == PluginConfig(0.4, False)
    with pytest.raises(ValueError, match="global_cache_hit_threshold"):
        PluginConfig.from_additional_config({"global_cache_hit_threshold": 3})
    with pytest.raises(ValueError, match="cache_hit_arrival_check"):
        PluginConfig.from_additional_config({"cache_hit_arrival_check": "no"})


def test_request_value_overrides_global_default() -> None:
    cfg = PluginConfig(global_threshold=0.5)
    assert effective_threshold(None, cfg) == 0.5
    assert effective_threshold({"cache_hit_threshold": 0.0}, cfg) == 0.0
    assert effective_threshold({"cache_hit_threshold": 0.8}, cfg) == 0.8
    # A bad value that bypassed the API server is ignored, not fatal.
    assert effective_threshold({"cache_hit_threshold": "x"}, cfg) == 0.5


def test_hit_rate_rule() -> None:
    assert below_threshold(0, 100, 0.5)
    assert below_threshold(49, 100, 0.5)
    assert not below_threshold(50, 100, 0.5)
    assert not below_threshold(0, 100, 0.0)  # T = 0 never rejects
    assert below_threshold(99, 100, 1.0)  # T = 1 needs every token cached
    assert not below_threshold(0, 0, 0.9)  # nothing to compute


def test_prefill_legs_are_recognised() -> None:
    assert is_prefill_leg({"do_remote_decode": True, "do_remote_prefill": False})
    assert not is_prefill_leg({"do_remote_prefill": True})
    assert not is_prefill_leg(None)
    assert not is_prefill_leg({})
