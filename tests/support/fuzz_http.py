"""The fuzzing tests' router and exchanges: `fuzz_router` (one simulated engine and one
router, real processes, per test module; re-exported by reliability/conftest.py), bounded
HTTP exchanges, and the checks every fuzzed answer must pass (never a 500 of the router's
own, a well-formed error body, the router still serving)."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from support.metrics import parse_metrics
from support.subprocess_cluster import MODEL, RouterProc, SimProc, sim_backends

READ_TIMEOUT_S = 1.5
EXCHANGE_BOUND_S = 15.0  # any single exchange taking longer is a hang
# The request fields the fuzzing puts odd values (or deep nesting) into.
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "top_p",
    "logprobs",
    "top_logprobs",
    "echo",
    "stop",
    "seed",
    "vllm_xargs",
    "request_id",
    "kv_transfer_params",
    "cache_hit_threshold",
    "return_token_ids",
    "use_beam_search",
    "prompt_logprobs",
    "prompt_embeds",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
    "user",
]


@pytest.fixture(scope="module")
def fuzz_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    """One engine and one router for the whole module (the fuzzing must not break them:
    every test ends by checking the router still serves)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    sim = SimProc(["--speed", "500", "--max-model-len", "4096"], log_path=tmp / "sim.log")
    router = RouterProc(
        {
            "server": {"max_body_bytes": 256 * 1024, "body_timeout_s": READ_TIMEOUT_S, "max_concurrent_requests": 64},
            "timeouts": {"first_token_s": 10.0, "idle_s": 10.0, "total_s": 20.0},
            "health": {"scrape_interval_s": 0.5, "check_interval_s": 1.0},
            "backends": sim_backends({"d0": sim}),
        },
        tmp,
    )
    try:
        sim.start()
        router.config["backends"] = sim_backends({"d0": sim})
        router.start()
        yield router
    finally:
        router.stop()
        sim.stop()


def fuzz_request(
    port: int, method: str, path: str, body: bytes | None, headers: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=EXCHANGE_BOUND_S)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def check_answer(status: int, headers: dict[str, Any], raw: bytes, what: object) -> None:
    assert status != 500, (what, raw[:500])
    ctype = headers.get("Content-Type", "")
    if status == 200:
        if ctype.startswith("text/event-stream"):
            assert raw.rstrip().endswith(b"data: [DONE]"), (what, raw[-300:])
            for block in raw.split(b"\n\n"):
                if block.startswith(b"data: {"):
                    orjson.loads(block[6:])
        else:
            orjson.loads(raw)
        return
    err = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, (what, err)
    assert err["code"] == status, (what, err)
    if status >= 500:
        assert "pstream" in err["message"] or "engine" in err["message"], (what, err)


def assert_alive(port: int) -> None:
    status, _, raw = fuzz_request(
        port, "POST", "/v1/completions", orjson.dumps({"model": MODEL, "prompt": "still here?", "max_tokens": 2})
    )
    assert status == 200, raw
    assert fuzz_request(port, "GET", "/health", None)[0] == 200


def requests_recorded(port: int) -> float:
    status, _, raw = fuzz_request(port, "GET", "/metrics", None)
    assert status == 200
    return parse_metrics(raw.decode()).sample_or_zero("cachehit_router_requests_total")


def assert_no_500s(port: int) -> None:
    status, _, raw = fuzz_request(port, "GET", "/metrics", None)
    assert status == 200
    assert parse_metrics(raw.decode()).sample_or_zero("cachehit_router_requests_total", status="500") == 0
