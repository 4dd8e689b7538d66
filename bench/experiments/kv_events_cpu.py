"""`python -m bench kv-events-cpu --out OUT [--batches N] [--rate R] [--reps K]`: the
router's CPU per KV-event batch.

A router (its own process, `router --config`, probe mode) follows one engine's KV-event
stream. This process publishes batches through the simulator's publisher
(engine_launcher/sim/kv_event_publisher.py): one stored block each, a new chain of four
blocks every four batches, at R batches/s (a busy vLLM engine publishes one per scheduler
step, every 20-60 ms; several engines' streams add up). The router's process CPU over
the batches, less its CPU over as long a stretch with none, over N. The engine's HTTP side
is a port nothing listens on: its failing health checks cost the same in both stretches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.cluster import RouterOptions, metric_sum, router_toml, scrape
from bench.harness.procs import PY, ProcessSet, RSSSampler, free_ports, wait_http
from bench.harness.stats import median, rnd
from bench.reports.render import console, markdown_table, table
from engine_launcher.sim.kv_event_publisher import ZmqEventPublisher
from engine_launcher.sim.kv_events import BlockStored, KVEventBatch, encode_batch

BLOCK = 16


def batches(n: int) -> list[bytes]:
    """n encoded batches of one stored block each, chained four blocks deep."""
    out = []
    for i in range(n):
        parent = None if i % 4 == 0 else i - 1
        stored = BlockStored([i], parent, list(range(i * BLOCK, (i + 1) * BLOCK)), BLOCK, None, "GPU", None)
        out.append(encode_batch(KVEventBatch(time.time(), [stored])))
    return out


async def publish(pub: ZmqEventPublisher, payloads: list[bytes], rate: float) -> None:
    start = time.monotonic()
    for i, p in enumerate(payloads):
        pub.publish(p)
        delay = start + (i + 1) / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


async def measure(a: argparse.Namespace, procs: ProcessSet, out: Path) -> dict[str, Any]:
    events_port, replay_port, router_port, dead_port = free_ports(4)
    # vLLM's rule, which the simulator's publisher follows: a wildcard host is bound.
    pub = ZmqEventPublisher(f"tcp://*:{events_port}", f"tcp://127.0.0.1:{replay_port}", 10_000, 100_000, 100_000, "")
    try:
        engine = f"http://127.0.0.1:{dead_port}"
        cfg = out / "router.toml"
        streams = {engine: (f"tcp://127.0.0.1:{events_port}", pub.replay_endpoint or "")}
        cfg.write_text(router_toml(router_port, [engine], [], RouterOptions(strategy="probe"), streams))
        router = procs.start("router", [PY, "-m", "router", "--config", str(cfg), "--no-engines"])
        await wait_http(f"http://127.0.0.1:{router_port}/v1/models", router, 30)
        await publish(pub, batches(64), 200.0)  # the subscription joins: ZMQ drops what it sent before
        await asyncio.sleep(1.0)
        sampler = RSSSampler(router.pid)
        rows = []
        for _ in range(a.reps):
            seconds = a.batches / a.rate
            c0 = sampler.cpu_s()
            await asyncio.sleep(seconds)
            idle = sampler.cpu_s() - c0
            c0 = sampler.cpu_s()
            await publish(pub, batches(a.batches), a.rate)
            await asyncio.sleep(0.5)  # the last ones applied
            busy = sampler.cpu_s() - c0 - idle * 0.5 / seconds
            rows.append((busy - idle) / a.batches * 1e6)
        async with aiohttp.ClientSession() as session:  # the batches reached the index
            blocks = metric_sum(
                await scrape(session, f"http://127.0.0.1:{router_port}"), "cachehit_router_kv_index_blocks"
            )
        procs.stop(router)
    finally:
        pub.close()
    return {
        "batches": a.batches,
        "rate": a.rate,
        "us_per_batch": [rnd(r, 1) for r in rows],
        "median": rnd(median(rows), 1),
        "indexed_blocks": blocks,
    }


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with ProcessSet(out / "logs") as procs:
        result = asyncio.run(measure(a, procs, out))
    cols = [
        ("batches", "batches"),
        ("rate", "batches/s"),
        ("median", "router CPU us/batch, median"),
        ("us_per_batch", "each"),
        ("indexed_blocks", "blocks in the router's index"),
    ]
    row = {**result, "us_per_batch": ", ".join(f"{x:g}" for x in result["us_per_batch"])}
    console.print(table("Router CPU per KV-event batch", cols, [row], {"median": 1}))
    (out / "kv_events_cpu.json").write_text(json.dumps(result, indent=2))
    (out / "kv_events_cpu.md").write_text(markdown_table(cols, [row], {"median": 1}) + "\n")
    return 0
