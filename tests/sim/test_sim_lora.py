"""LoRA adapters in the simulator: --lora-modules and --lora-load-s on the command line,
and a runtime load that takes its time."""

from __future__ import annotations

import asyncio

import aiohttp

from engine_launcher.sim.cli import build_parser, config_from_args
from support.sim_http import MakeEngine


def test_the_command_line_serves_adapters_and_sets_the_load_cost() -> None:
    args = build_parser().parse_args(
        ["--port", "0", "--lora-modules", "sql=/adapters/sql", "chat", "--lora-load-s", "0.25"]
    )
    cfg = config_from_args(args)
    assert cfg.lora_modules == {"sql": "/adapters/sql", "chat": "chat"}
    assert cfg.lora_load_s == 0.25


async def test_a_runtime_load_takes_the_load_cost(make_engine: MakeEngine, http: aiohttp.ClientSession) -> None:
    # 0.3 s at speed 1: a lower bound, whatever the machine's load.
    eng = await make_engine(model="sim-model", speed=1.0, lora_load_s=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    async with http.post(eng.url + "/v1/load_lora_adapter", json=body) as r:
        assert r.status == 200
    assert loop.time() - started >= 0.3
    assert eng.config.lora_modules == {"sql": "/adapters/sql"}
