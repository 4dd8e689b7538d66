"""Real vLLM 0.32 engines (CPU build, tiny model, threshold plugin; conftest.py):

- `/v1/messages` and `/v1/responses` through the router answer what the engine answers
  directly, greedy, whole and streamed (ids, and the cache figures in usage, aside);
- llm-d's decode-first flow speaks to the plugin in its own request shapes: a request
  with a top-level `cache_hit_threshold` the decoder cannot meet comes back HTTP 200 with
  `finish_reason: "cache_threshold"` (whole and streamed); the prefill request its
  sidecar then sends (threshold 0, one token, NIXL `do_remote_decode`) is served; the
  original request, sent on to a decoder with the producer's `kv_transfer_params` and
  its threshold unchanged, is accepted (the KV it pulls counts as hit).

The "threshold" engine has a global threshold of 0.5, so direct requests that must not
be rejected carry `vllm_xargs.cache_hit_threshold: 0`.
"""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from router.config.parse import parse_config
from router.server.app import build_app
from support.ports import serve_on_free_port
from support.real_engine import EngineProcess, post_json, post_sse

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]

MODEL = "tiny"
T0 = {"cache_hit_threshold": 0.0}


def _prompt(words: int = 40) -> str:
    tag = uuid.uuid4().hex[:10]
    return tag + " " + " ".join(f"word{i % 17} item{i}" for i in range(words))


async def _router(url: str) -> tuple[web.AppRunner, str]:
    config = parse_config(
        {
            "server": {"port": 0},
            "routing": {"race": "always"},
            "timeouts": {"first_token_s": 120, "idle_s": 120, "total_s": 600},
            "health": {"scrape_interval_s": 2.0, "check_interval_s": 4.0},
            "backends": [{"name": "engine", "url": url, "role": "decode"}],
        }
    )
    return await serve_on_free_port(build_app(config, start_engines=False), cancel_handlers=True)


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with session.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read()


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            fields = dict(line.split(": ", 1) for line in block.split("\n"))
            out.append((fields["event"], orjson.loads(fields["data"])))
    return out


def _without_ids(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, Any]]:
    """What must match: event names and the generated content (ids, creation times and
    the usage's cache figures differ between two answers). Consecutive text deltas are
    joined: how many tokens vLLM puts in one delta depends on how fast its reader is."""
    kept: list[tuple[str, Any]] = []
    for name, data in events:
        delta = data.get("delta")
        if isinstance(delta, dict) and delta.get("type") == "text_delta" and kept:
            last_name, last = kept[-1]
            if last_name == name and last["delta"].get("type") == "text_delta" and last["index"] == data["index"]:
                last["delta"] = {**last["delta"], "text": last["delta"]["text"] + delta["text"]}
                continue
        if "delta" in data:
            kept.append((name, {k: v for k, v in data.items() if k in ("delta", "index")}))
        else:
            kept.append((name, data.get("index")))
    return kept


def _joined(names: list[str], repeated: str) -> list[str]:
    """`names` with each run of `repeated` counted once (see _without_ids)."""
    return [n for i, n in enumerate(names) if n != repeated or i == 0 or names[i - 1] != repeated]


async def test_messages_through_the_router_equal_the_engines_own(threshold_engine: EngineProcess) -> None:
    runner, router = await _router(threshold_engine.base_url)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            body = {
                "model": MODEL,
                "max_tokens": 12,
                "temperature": 0,
                "system": _prompt(),
                "messages": [{"role": "user", "content": "go on"}],
            }
            status, raw = await _post(s, router + "/v1/messages", body)
            assert status == 200, raw
            routed = orjson.loads(raw)
            status, raw = await _post(s, threshold_engine.base_url + "/v1/messages", {**body, "vllm_xargs": T0})
            assert status == 200, raw
            direct = orjson.loads(raw)
            for key in ("type", "role", "content", "model", "stop_reason", "stop_sequence"):
                assert routed.get(key) == direct.get(key), key
            assert routed["usage"]["output_tokens"] == direct["usage"]["output_tokens"] == 12

            streamed = {**body, "stream": True}
            status, raw = await _post(s, router + "/v1/messages", streamed)
            assert status == 200, raw
            routed_events = _events(raw)
            status, raw = await _post(s, threshold_engine.base_url + "/v1/messages", {**streamed, "vllm_xargs": T0})
            assert status == 200, raw
            direct_events = _events(raw)
            assert _without_ids(routed_events) == _without_ids(direct_events)
            text = "".join(d["delta"].get("text", "") for n, d in routed_events if n == "content_block_delta")
            assert text == routed["content"][0]["text"]
    finally:
        await runner.cleanup()


async def test_responses_through_the_router_equal_the_engines_own(threshold_engine: EngineProcess) -> None:
    runner, router = await _router(threshold_engine.base_url)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            body = {
                "model": MODEL,
                "max_output_tokens": 12,
                "temperature": 0,
                "instructions": _prompt(),
                "input": "go on",
            }
            status, raw = await _post(s, router + "/v1/responses", body)
            assert status == 200, raw
            routed = orjson.loads(raw)
            status, raw = await _post(s, threshold_engine.base_url + "/v1/responses", {**body, "vllm_xargs": T0})
            assert status == 200, raw
            direct = orjson.loads(raw)
            for key in ("object", "status", "incomplete_details", "model", "temperature", "max_output_tokens"):
                assert routed.get(key) == direct.get(key), key
            assert [i["content"] for i in routed["output"]] == [i["content"] for i in direct["output"]]
            assert routed["usage"]["output_tokens"] == direct["usage"]["output_tokens"] == 12

            streamed = {**body, "stream": True}
            status, raw = await _post(s, router + "/v1/responses", streamed)
            assert status == 200, raw
            routed_events = _events(raw)
            status, raw = await _post(s, threshold_engine.base_url + "/v1/responses", {**streamed, "vllm_xargs": T0})
            assert status == 200, raw
            direct_events = _events(raw)
            delta = "response.output_text.delta"
            assert _joined([n for n, _ in routed_events], delta) == _joined([n for n, _ in direct_events], delta)
            text = "".join(d["delta"] for n, d in routed_events if n == delta)
            assert text == "".join(d["delta"] for n, d in direct_events if n == delta)
            assert text == routed["output"][-1]["content"][0]["text"]
    finally:
        await runner.cleanup()


# --- llm-d's decode-first flow, in its sidecar's request shapes --------------------------


def _llmd_chat(content: str, **kw: Any) -> dict[str, Any]:
    """A client body as llm-d's sidecar forwards it: the threshold at the top level."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "max_completion_tokens": 8,
        "temperature": 0,
        "cache_hit_threshold": 0.8,
        **kw,
    }


def _llmd_prefill(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request llm-d's NIXL sidecar builds after a rejection."""
    prefill = {k: v for k, v in body.items() if k != "stream_options"}
    prefill.update(
        stream=False,
        max_tokens=1,
        max_completion_tokens=1,
        cache_hit_threshold=0,  # an integer, as the sidecar sends it
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    return prefill


def test_llmd_decode_first_rejection_prefill_and_decode(
    threshold_engine: EngineProcess, preemption_engine: EngineProcess
) -> None:
    decoder, producer = preemption_engine.base_url, threshold_engine.base_url
    body = _llmd_chat(_prompt(8))  # the decoder is the tiny-KV engine: 224 tokens of context
    # 1. The decoder does not hold the prompt: HTTP 200, first choice cache_threshold.
    status, out = post_json(decoder, "/v1/chat/completions", body, timeout=300)
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] == "cache_threshold"
    assert out["usage"]["completion_tokens"] == 0
    # Streamed: the sidecar scans the stream's data events for a first choice with that reason.
    status, events = post_sse(decoder, "/v1/chat/completions", {**body, "stream": True}, timeout=300)
    assert status == 200, events
    finishes = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices")]
    assert finishes[-1] == "cache_threshold"
    assert events[-1] == "[DONE]"
    # 2. Its prefill request, on the producer: served, never rejected, KV handed over.
    status, prefilled = post_json(producer, "/v1/chat/completions", _llmd_prefill(body), timeout=300)
    assert status == 200, prefilled
    assert prefilled["choices"][0]["finish_reason"] == "length"
    params = prefilled["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    # 3. The original request with the producer's parameters, threshold unchanged: the KV
    # the decoder pulls counts as hit, so it is accepted and generates.
    status, decoded = post_json(decoder, "/v1/chat/completions", {**body, "kv_transfer_params": params}, timeout=300)
    assert status == 200, (decoded, preemption_engine.log_tail())
    assert decoded["choices"][0]["finish_reason"] != "cache_threshold"
    assert decoded["usage"]["completion_tokens"] >= 1


def test_llmd_threshold_on_completions_and_its_validation(threshold_engine: EngineProcess) -> None:
    url = threshold_engine.base_url
    body = {"model": MODEL, "prompt": _prompt(30), "max_tokens": 4, "temperature": 0, "cache_hit_threshold": 1}
    status, out = post_json(url, "/v1/completions", body, timeout=300)
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] == "cache_threshold"
    # A threshold of 0 always runs, whatever the engine-wide default (here 0.5).
    status, out = post_json(url, "/v1/completions", {**body, "cache_hit_threshold": 0}, timeout=300)
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] == "length"
    status, out = post_json(url, "/v1/completions", {**body, "cache_hit_threshold": 1.5}, timeout=300)
    assert status == 400, out
    assert out["error"]["param"] == "cache_hit_threshold"


def test_messages_take_the_threshold_at_the_top_level_too(threshold_engine: EngineProcess) -> None:
    url = threshold_engine.base_url
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": _prompt(30)}]}
    status, out = post_json(url, "/v1/messages", {**body, "cache_hit_threshold": 1}, timeout=300)
    assert status == 200, out
    # cache_threshold has no Anthropic name: no stop_reason, one empty text block.
    assert "stop_reason" not in out
    assert out["content"] == [{"type": "text", "text": ""}]
    assert out["usage"]["output_tokens"] == 0
    status, out = post_json(url, "/v1/messages", {**body, "cache_hit_threshold": 0}, timeout=300)
    assert status == 200, out
    assert out["stop_reason"] == "max_tokens"
    status, out = post_json(url, "/v1/messages", {**body, "cache_hit_threshold": 1.5}, timeout=300)
    assert status == 400, out
    assert out["type"] == "error"
    assert "cache_hit_threshold" in out["error"]["message"]
