"""The simulator against captures of a real vLLM 0.32 engine (tests/fixtures/vllm_wire/,
docs/VLLM_WIRE.md): every capture is replayed against a simulated engine and the answers
must have the same status, the same keys in the same order at every level, the same JSON
types and the same SSE framing. Generated text and token ids differ (a different model);
errors must match field for field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from engine_launcher.sim import SimEngineHandle
from support.sim_http import MakeEngine
from support.sse import parse_sse

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_wire"
ALL = sorted(p.name for p in FIXTURES.glob("*.json"))
# Captures that are not a single request/answer pair; they have their own tests below.
SPECIAL = {"metrics.json", "disagg_consumer_metrics.json", "disagg_decode_leg_stream.json"}


def load(name: str) -> dict[str, Any]:
    capture: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return capture


def shape(x: Any, key: str | None = None) -> Any:
    """The structure of a JSON value: keys in order, types, first element of lists."""
    if isinstance(x, dict):
        if key == "top_logprobs":  # completions: a map from token text to logprob
            return [("<token>", "number")] if x else []
        return [(k, shape(v, k)) for k, v in x.items()]
    if isinstance(x, list):
        return [shape(x[0], key)] if x else []
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, (int, float)):
        return "number"
    return "str"


def sse_shapes(events: list[Any]) -> list[Any]:
    """Shapes of the chunks of a stream, consecutive repeats collapsed (the simulator may
    merge several tokens into one chunk, as vLLM does when its client is slow)."""
    out: list[Any] = []
    for e in events:
        s = "[DONE]" if e == "[DONE]" else shape(e)
        if not out or out[-1] != s:
            out.append(s)
    return out


def by_choice(events: list[Any]) -> list[Any]:
    """A stream's choice chunks grouped by choice index, in order within a choice: the
    interleaving of n > 1 choices is the engine's timing, not part of the wire format."""
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    rest = [e for e in events if not (isinstance(e, dict) and e.get("choices"))]
    return sorted(chunks, key=lambda e: e["choices"][0]["index"]) + rest


def real_answer(fx: dict[str, Any]) -> Any:
    raw = fx.get("raw", "")
    if fx["request"]["path"] in ("/v1/completions", "/v1/chat/completions") and raw.startswith("data: "):
        return parse_sse(raw.encode())
    return orjson.loads(raw) if raw else raw


@pytest.fixture
async def tiny(make_engine: MakeEngine) -> SimEngineHandle:
    # As the captured engine: served name "tiny", 2048 tokens of context, block size 32,
    # and no --enable-prompt-tokens-details (so usage.prompt_tokens_details is null).
    return await make_engine(
        model="tiny", max_model_len=2048, block_size=32, role="both", enable_prompt_tokens_details=False
    )


async def replay(http: aiohttp.ClientSession, eng: SimEngineHandle, request: dict[str, Any]) -> tuple[int, Any]:
    url = eng.url + request["path"]
    if request["method"] == "GET":
        async with http.get(url) as r:
            raw = await r.read()
            return r.status, (orjson.loads(raw) if raw else "")
    body = request["body"]
    data = body.encode() if isinstance(body, str) else orjson.dumps(body)
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        raw = await r.read()
        if r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return r.status, parse_sse(raw)
        return r.status, orjson.loads(raw)


def test_the_captures_are_there() -> None:
    assert len(ALL) >= 20, "tests/fixtures/vllm_wire should hold the captured wire"


@pytest.mark.parametrize("name", [n for n in ALL if n not in SPECIAL])
async def test_replayed_capture_has_the_same_wire_shape(
    name: str, tiny: SimEngineHandle, http: aiohttp.ClientSession
) -> None:
    fx = load(name)
    status, answer = await replay(http, tiny, fx["request"])
    assert status == fx["status"], answer
    real = real_answer(fx)
    if isinstance(real, dict) and "error" in real:
        assert answer == real
    elif isinstance(real, list):
        assert sse_shapes(by_choice(answer)) == sse_shapes(by_choice(real))
    elif real == "":
        assert answer == ""
    else:
        assert shape(answer) == shape(real)


async def test_decode_leg_stream_matches_the_capture(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    fx = load("disagg_decode_leg_stream.json")
    producer = await make_engine(
        model="tiny", max_model_len=2048, block_size=32, role="producer", enable_prompt_tokens_details=False
    )
    consumer = await make_engine(
        model="tiny", max_model_len=2048, block_size=32, role="consumer", enable_prompt_tokens_details=False
    )
    body = dict(fx["request"]["body"])
    prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prefill.update(
        max_tokens=1,
        stream=False,
        kv_transfer_params=load("disagg_prefill_leg.json")["request"]["body"]["kv_transfer_params"],
    )
    status, prefilled = await replay(http, producer, {"method": "POST", "path": "/v1/completions", "body": prefill})
    assert status == 200
    body["kv_transfer_params"] = prefilled["kv_transfer_params"]
    assert [k for k in body["kv_transfer_params"]] == [k for k in fx["request"]["body"]["kv_transfer_params"]]
    status, answer = await replay(http, consumer, {"method": "POST", "path": "/v1/completions", "body": body})
    assert status == fx["status"]
    assert sse_shapes(answer) == sse_shapes(real_answer(fx))
    # As the capture: the consumer's first token is the one the producer generated.
    assert answer[0]["choices"][0]["token_ids"][0] == prefilled["choices"][0]["token_ids"][0]
    # And the consumer's counters follow the captured pattern (all prompt tokens external).
    real = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in load("disagg_consumer_metrics.json")["lines"]}
    async with http.get(consumer.url + "/metrics") as r:
        text = await r.text()
    sim = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0] in real
    }
    n_prompt = answer[-2]["usage"]["prompt_tokens"]
    assert real["vllm:prefix_cache_queries_total"] == real["vllm:external_prefix_cache_hits_total"]
    assert sim == {
        "vllm:prefix_cache_queries_total": n_prompt,
        "vllm:prefix_cache_hits_total": 0.0,
        "vllm:external_prefix_cache_hits_total": n_prompt,
    }


def _families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """family name -> (type, label names of its samples, without histogram `le`)."""
    out: dict[str, tuple[str, set[str]]] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            types[name] = typ
    for name, typ in types.items():
        out[name] = (typ, set())
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sample = line.split("{")[0].split(" ")[0]
        labels = set()
        if "{" in line:
            labels = {kv.split("=")[0] for kv in line.split("{")[1].split("}")[0].split(",")}
        labels.discard("le")
        for name in (sample, sample.rsplit("_", 1)[0]):
            if name in out:
                out[name][1].update(labels)
                break
    return {k: (t, frozenset(ls)) for k, (t, ls) in out.items()}


async def test_metrics_use_vllm_names_types_and_labels(tiny: SimEngineHandle, http: aiohttp.ClientSession) -> None:
    real = load("metrics.json")["families"]
    async with http.get(tiny.url + "/metrics") as r:
        sim = _families(await r.text())
    for name, (typ, labels) in sim.items():
        if not name.startswith("vllm:") or name.endswith("_created"):
            continue
        key = name
        assert key in real, f"{key}: not a vLLM 0.32 metric"
        assert real[key]["type"] == typ, key
        real_labels = set()
        # The capture files a few samples under a neighbouring family: look at them all.
        for sample in (x for fam in real.values() for x in fam["samples"]):
            base = sample.split("{")[0]
            if "{" in sample and base in (key, key + "_bucket", key + "_count", key + "_sum"):
                real_labels |= {kv.split("=")[0] for kv in sample.split("{")[1].rstrip("}").split(",")}
        real_labels.discard("le")
        assert labels <= real_labels, (key, labels, real_labels)
    for required in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:external_prefix_cache_queries",
        "vllm:external_prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:request_success",
        "vllm:time_to_first_token_seconds",
        "vllm:cache_config_info",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
    ):
        assert required in sim or required + "_total" in sim, required
