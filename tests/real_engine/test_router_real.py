"""The router in front of real vLLM engines (CPU build, tiny random model, threshold plugin).

Uses the session's two engines (see conftest.py): "threshold" (NIXL kv_both) serves as the
prefill (producer) backend, "preemption" (NIXL kv_both, 8 KV blocks) as the only decode
(consumer) backend. Shows, with real engines:
- a cold request is rejected by the probe, prefilled on the producer and decoded on the
  consumer, whose own metrics count the prompt as external (NIXL) hits;
- preemption on the tiny consumer hands requests back with cache_threshold and their
  tokens; the router resumes them and every client gets its full max_tokens;
- a simulated engine answers the same requests with the same JSON keys, SSE framing,
  finish reasons and metric names.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson
import pytest

from engine_launcher.sim import SimEngineConfig, start_sim_engine
from router.config.parse import parse_config
from router.server.app import ROUTER_KEY, build_app
from support.metrics import registry_metrics
from support.ports import serve_on_free_port
from support.real_engine import EngineProcess, scrape_metrics
from support.sse import read_sse

# Engine start-up (the session fixture) is charged to the first test: allow for a slow machine.
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]

MODEL = "tiny"
WORDS = [
    "river",
    "mountain",
    "quiet",
    "morning",
    "light",
    "window",
    "paper",
    "garden",
    "silver",
    "harbor",
    "winter",
    "lantern",
    "meadow",
    "orchard",
    "candle",
    "copper",
    "valley",
    "thunder",
]


def cold_prompt(tag: str, words: int) -> str:
    start = sum(tag.encode())
    return tag + " " + " ".join(WORDS[(start + 7 * i) % len(WORDS)] for i in range(words))


class RealCluster:
    def __init__(self, producer_url: str, consumer_url: str, routing: dict[str, Any]) -> None:
        self.config = parse_config(
            {
                "server": {"port": 0},
                # These tests are of the split's mechanics: every request races and every prompt
                # nobody accepted is split, whatever the cost model would say of these engines.
                "routing": {"min_pd_prompt_tokens": 16, "race": "always", "split": "always", **routing},
                "timeouts": {"first_token_s": 120, "idle_s": 120, "total_s": 600},
                # vLLM on two busy CPU cores can take seconds to answer /metrics.
                "health": {"scrape_interval_s": 2.0, "check_interval_s": 4.0},
                "backends": [
                    {"name": "producer", "url": producer_url, "role": "prefill"},
                    {"name": "consumer", "url": consumer_url, "role": "decode"},
                ],
            }
        )

    async def __aenter__(self) -> RealCluster:
        self.app = build_app(self.config, start_engines=False)
        self.runner, self.url = await serve_on_free_port(self.app, cancel_handlers=True)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        await self.runner.cleanup()

    def metric(self, name: str, **labels: str) -> float:
        """Summed over the label sets that include `labels` (e.g. any `model`); fails when
        there is no such sample (support/metrics.py)."""
        return registry_metrics(self.app[ROUTER_KEY].metrics.registry).value(name, **labels)

    def metric_or_zero(self, name: str, **labels: str) -> float:
        """`metric`, but 0.0 for a declared metric with no sample with these labels."""
        return registry_metrics(self.app[ROUTER_KEY].metrics.registry).sample_or_zero(name, **labels)

    async def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            return r.status, orjson.loads(await r.read())

    async def stream(self, body: dict[str, Any]) -> tuple[int, list[Any]]:
        async with self.session.post(self.url + "/v1/completions", json={**body, "stream": True}) as r:
            return r.status, (await read_sse(r) if r.status == 200 else [])


async def test_cold_request_is_prefilled_on_the_producer_and_decoded_on_the_consumer(
    threshold_engine: EngineProcess, preemption_engine: EngineProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cachehit_router")
    async with RealCluster(threshold_engine.base_url, preemption_engine.base_url, {"cache_hit_threshold": 0.5}) as c:
        # A first request through the router. Should its KV transfer fail (vLLM's
        # kv_load_failure_policy "fail": e.g. a NIXL handshake past vLLM's 5 s on this loaded
        # machine, though conftest.py warms the handshakes up), the router computes the
        # prompt on the consumer instead and the client still gets its answer.
        failed_before = scrape_metrics(preemption_engine.base_url).value("vllm:nixl_num_failed_transfers_total")
        status, out = await c.complete(
            {"model": MODEL, "prompt": cold_prompt("handshake", 30), "max_tokens": 8, "temperature": 0}
        )
        assert status == 200, (out, preemption_engine.log_tail())
        assert out["usage"]["completion_tokens"] == 8
        if c.metric_or_zero("cachehit_router_requests_total", route="pd", status="200") != 1:
            assert c.metric("cachehit_router_requests_total", route="direct", status="200") == 1
            assert "did not start" in caplog.text, caplog.text[-3000:]
            failed = (
                scrape_metrics(preemption_engine.base_url).value("vllm:nixl_num_failed_transfers_total") - failed_before
            )
            print(
                f"\n[real engine] first NIXL transfer failed (failed transfers counted: {failed:.0f}); "
                "the router computed the prompt on the consumer"
            )

        before = scrape_metrics(preemption_engine.base_url)
        pd_before = c.metric_or_zero("cachehit_router_requests_total", route="pd", status="200")
        rejections_before = c.metric_or_zero(
            "cachehit_router_probe_rejections_total", backend="consumer"
        ) + c.metric_or_zero("cachehit_router_probe_deadline_expiries_total", backend="consumer")
        # ~75 tokens: the consumer's context is 224 tokens (conftest.py).
        status, out = await c.complete(
            {"model": MODEL, "prompt": cold_prompt("nixl", 30), "max_tokens": 8, "temperature": 0}
        )
        assert status == 200, (out, preemption_engine.log_tail())
        prompt_tokens = out["usage"]["prompt_tokens"]
        assert out["usage"]["completion_tokens"] == 8
        assert c.metric("cachehit_router_requests_total", route="pd", status="200") == pd_before + 1, caplog.text[
            -3000:
        ]
        # The consumer said no: a rejection, or silence past the probe deadline (a loaded
        # machine), which the race counts as one.
        assert (
            c.metric_or_zero("cachehit_router_probe_rejections_total", backend="consumer")
            + c.metric_or_zero("cachehit_router_probe_deadline_expiries_total", backend="consumer")
            - rejections_before
        ) == 1, caplog.text[-3000:]
    after = scrape_metrics(preemption_engine.base_url)
    external = after.value("vllm:external_prefix_cache_hits_total") - before.value(
        "vllm:external_prefix_cache_hits_total"
    )
    # The consumer pulled the prompt's KV over NIXL (vLLM recomputes at most the last token's block).
    assert external >= prompt_tokens - 32, (external, prompt_tokens)


async def test_preempted_requests_are_resumed_into_full_answers(
    threshold_engine: EngineProcess, preemption_engine: EngineProcess
) -> None:
    before = scrape_metrics(preemption_engine.base_url)
    # Prompt (~50 tokens) + 150 fits the consumer's 224-token context; two at once do not fit
    # its 8 blocks of 32 tokens, so it preempts.
    max_tokens = 150
    async with RealCluster(
        threshold_engine.base_url,
        preemption_engine.base_url,
        {"cache_hit_threshold": 0.5, "decode_guard_threshold": 0.5, "max_resumes": 10},
    ) as c:
        bodies = [
            {
                "model": MODEL,
                "prompt": cold_prompt(f"preempt{i}", 20),
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            for i in range(4)
        ]
        results = await asyncio.gather(
            *(c.complete(b) for b in bodies[:2]),
            *(c.stream({**b, "stream_options": {"include_usage": True}}) for b in bodies[2:]),
        )
        for status, out in results[:2]:
            assert status == 200, out
            assert out["usage"]["completion_tokens"] == max_tokens
            assert out["choices"][0]["finish_reason"] == "length"
        for status, events in results[2:]:
            assert status == 200
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == max_tokens
            assert not any(isinstance(e, dict) and "error" in e for e in events)
            finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
            assert finishes[-1] == "length"
            assert "cache_threshold" not in finishes
        resumed = c.metric_or_zero("cachehit_router_resumes_total", reason="preempted")
    after = scrape_metrics(preemption_engine.base_url)
    preemptions = after.value("vllm:num_preemptions_total") - before.value("vllm:num_preemptions_total")
    print(f"\n[real engine] preemptions on the consumer: {preemptions:.0f}, router resumes: {resumed:.0f}")
    assert preemptions >= 1
    assert resumed >= 1


def _key_paths(obj: Any, prefix: str = "") -> set[str]:
    """Schema paths of a JSON value; `top_logprobs` maps sampled tokens, not field names."""
    out: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(prefix + k)
            if k != "top_logprobs":
                out |= _key_paths(v, prefix + k + ".")
    elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
        for item in obj:
            out |= _key_paths(item, prefix + "[].")
    return out


PARITY_REQUESTS = [
    ("/v1/completions", {"prompt": cold_prompt("parity-a", 30), "max_tokens": 5, "cache_hit_threshold": 0}),
    (
        "/v1/completions",
        {
            "prompt": cold_prompt("parity-b", 30),
            "max_tokens": 5,
            "cache_hit_threshold": 0,
            "return_token_ids": True,
            "logprobs": 2,
        },
    ),
    ("/v1/completions", {"prompt": cold_prompt("parity-c", 30), "max_tokens": 5, "cache_hit_threshold": 0.9}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": cold_prompt("parity-d", 30)}],
            "max_tokens": 5,
            "cache_hit_threshold": 0,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": cold_prompt("parity-e", 30)}],
            "max_tokens": 5,
            "cache_hit_threshold": 0.9,
        },
    ),
]


async def _exchange(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], stream: bool
) -> tuple[int, bytes]:
    payload = {"model": MODEL, **body, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    async with session.post(url + path, json=payload) as r:
        raw = await r.read()
        return r.status, raw


async def test_the_simulator_matches_the_real_engine_where_the_router_looks(threshold_engine: EngineProcess) -> None:
    sim = await start_sim_engine(
        SimEngineConfig(model=MODEL, speed=100.0, block_size=32, global_cache_hit_threshold=0.5), port=0
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            for path, body in PARITY_REQUESTS:
                for stream in (False, True):
                    real_status, real_raw = await _exchange(s, threshold_engine.base_url, path, body, stream)
                    sim_status, sim_raw = await _exchange(s, sim.url, path, body, stream)
                    what = f"{path} stream={stream} {body.get('cache_hit_threshold')}"
                    assert real_status == sim_status == 200, what
                    if not stream:
                        real, simd = orjson.loads(real_raw), orjson.loads(sim_raw)
                        assert _key_paths(simd) == _key_paths(real), what
                        assert [c["finish_reason"] for c in simd["choices"]] == [
                            c["finish_reason"] for c in real["choices"]
                        ], what
                        continue
                    # SSE framing: every event is one `data: ` line followed by a blank line.
                    for raw in (real_raw, sim_raw):
                        assert raw.endswith(b"data: [DONE]\n\n"), what
                        assert all(block.startswith(b"data: ") for block in raw.split(b"\n\n") if block), what
                    real_ev = [orjson.loads(b[6:]) for b in real_raw.split(b"\n\n") if b and b != b"data: [DONE]"]
                    sim_ev = [orjson.loads(b[6:]) for b in sim_raw.split(b"\n\n") if b and b != b"data: [DONE]"]
                    real_fin = [c["finish_reason"] for e in real_ev for c in e["choices"] if c.get("finish_reason")]
                    sim_fin = [c["finish_reason"] for e in sim_ev for c in e["choices"] if c.get("finish_reason")]
                    assert sim_fin == real_fin, what
                    # Chunk shapes: the first, a middle and the usage chunk have the same keys.
                    assert _key_paths(sim_ev[0]) == _key_paths(real_ev[0]), what
                    assert _key_paths(sim_ev[-1]) == _key_paths(real_ev[-1]), what
            async with s.get(threshold_engine.base_url + "/metrics") as r:
                real_metrics = await r.text()
            async with s.get(sim.url + "/metrics") as r:
                sim_metrics = await r.text()
        wanted = [
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:external_prefix_cache_queries_total",
            "vllm:external_prefix_cache_hits_total",
            "vllm:num_preemptions_total",
            "vllm:request_success_total",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:cache_config_info",
        ]
        for name in wanted:
            assert f"\n{name}{{" in real_metrics, f"real engine lacks {name}"
            assert f"\n{name}{{" in sim_metrics, f"simulator lacks {name}"
        assert 'finished_reason="cache_threshold"' in real_metrics
        assert 'finished_reason="cache_threshold"' in sim_metrics
    finally:
        await sim.close()
