"""LoRA adapters through the router against a real vLLM engine (CPU build, tiny random
model): an adapter written at test time is loaded through the router's admin-only
/v1/load_lora_adapter (the path from the router's configuration), a request naming it is
answered by it, and /v1/unload_lora_adapter takes it away, each step seen by the router at
once.

The engine runs with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True. The adapter
is PEFT's format, as vLLM reads it: adapter_config.json and adapter_model.safetensors with
lora_A (rank x in) and lora_B (out x rank) for q_proj and v_proj of each layer of the tiny
model (hidden 128, 2 heads and 1 KV head of 64, 2 layers: engine_launcher/tiny_model.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from router.config.parse import parse_config
from router.server.app import ROUTER_KEY, build_app
from router.server.state import RouterState
from support.cluster import registry_of
from support.ports import free_port_below_ephemeral_range, serve_on_free_port
from support.real_engine import EngineProcess, EngineStartError, engine_command
from support.requirements import missing_dependency, require_module

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

MODEL = "tiny"
ADAPTER = "tiny-lora"
NAME = "engine"
ADMIN = {"Authorization": "Bearer sk-admin"}
RANK = 8
LAYERS = 2
HIDDEN = 128
KV_OUT = 64  # one KV head of 64


def write_adapter(path: Path) -> Path:
    """A random rank-8 LoRA adapter for the tiny model, in PEFT's files."""
    torch = require_module("torch")
    safetensors_torch = require_module("safetensors.torch")
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": ["q_proj", "v_proj"],
        "modules_to_save": None,
        "use_rslora": False,
        "base_model_name_or_path": MODEL,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(LAYERS):
        for proj, out in (("q_proj", HIDDEN), ("v_proj", KV_OUT)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=gen) * 0.01
    safetensors_torch.save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.fixture(scope="module")
def lora_engine(tiny_model: Path, engine_workdir: Path) -> Iterator[EngineProcess]:
    port = free_port_below_ephemeral_range()
    argv, env = engine_command(
        tiny_model,
        name="lora",
        port=port,
        nixl_port=free_port_below_ephemeral_range(),
        cpu_cores=(0,),
        extra_args=(
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "2",
            "--enable-lora",
            "--max-loras",
            "1",
            "--max-lora-rank",
            str(RANK),
        ),
        env={"TORCHDYNAMO_DISABLE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        log_dir=engine_workdir,
    )
    engine = EngineProcess(argv, env, port, engine_workdir / "lora.log").start()
    try:
        try:
            took = engine.wait_healthy(420)
        except (EngineStartError, OSError) as exc:
            missing_dependency(f"the LoRA vLLM engine did not start: {exc}")
        print(f"\n[real engine] lora: healthy after {took:.1f} s ({engine.base_url}, log {engine.log_path})")
        yield engine
    finally:
        engine.stop()


@pytest.fixture
async def router(lora_engine: EngineProcess, engine_workdir: Path) -> AsyncIterator[tuple[str, RouterState]]:
    adapter = write_adapter(engine_workdir / "tiny-lora")
    config = parse_config(
        {
            "server": {"port": 0, "admin_api_key": "sk-admin"},
            "routing": {"strategy": "least_loaded", "lora_adapters": {ADAPTER: str(adapter)}},
            "timeouts": {"first_token_s": 120, "idle_s": 120, "total_s": 300},
            # Rare checks: what the router knows of the adapter comes from its own calls.
            "health": {"scrape_interval_s": 2.0, "check_interval_s": 600.0},
            "backends": [{"name": NAME, "url": lora_engine.base_url, "role": "decode"}],
        }
    )
    app = build_app(config, start_engines=False)
    runner, url = await serve_on_free_port(app, cancel_handlers=True)
    try:
        yield url, app[ROUTER_KEY]
    finally:
        await runner.cleanup()


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any) -> tuple[int, Any]:
    async with s.post(url, json=body, **kw) as r:
        return r.status, orjson.loads(await r.read())


async def test_an_adapter_loaded_requested_and_unloaded_through_the_router(
    router: tuple[str, RouterState], lora_engine: EngineProcess
) -> None:
    url, state = router
    registry = registry_of(state)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        status, body = await _post(s, url + "/v1/load_lora_adapter", {"lora_name": ADAPTER}, headers=ADMIN)
        assert status == 200, (body, lora_engine.log_tail())
        assert body == {"lora_name": ADAPTER, "backends": [NAME]}
        assert registry.states[NAME].adapters == (ADAPTER,)
        async with s.get(lora_engine.base_url + "/v1/models") as r:
            cards = {m["id"]: m for m in (await r.json())["data"]}
        assert cards[ADAPTER]["parent"] == MODEL

        request = {"model": ADAPTER, "prompt": "one two three four", "max_tokens": 2, "temperature": 0}
        status, out = await _post(s, url + "/v1/completions", request)
        assert status == 200, (out, lora_engine.log_tail())
        assert out["model"] == ADAPTER
        assert out["usage"]["completion_tokens"] == 2

        status, body = await _post(s, url + "/v1/unload_lora_adapter", {"lora_name": ADAPTER}, headers=ADMIN)
        assert (status, body) == (200, {"lora_name": ADAPTER, "backends": [NAME]})
        assert registry.states[NAME].adapters == ()
        status, err = await _post(s, url + "/v1/completions", request)
        assert status == 404, err
        async with s.get(lora_engine.base_url + "/v1/models") as r:
            assert ADAPTER not in {m["id"] for m in (await r.json())["data"]}
