"""Router replicas and engine restarts for `python -m bench replay`.

`--routers N` starts N router processes of the mode (ours, vllm-router or SGLang's `smg`),
each configured with the same engines, and the load generator sends request k to replica
k mod N, as an L4 load balancer spreads connections. Replicas share nothing: ours agree
because they ask the engines (the probe race); an index-based router (prefix_tree,
cache_aware) keeps its own guess of what each engine holds, built only from the requests
it routed itself.

`--restart-engine-at S` stops one decode engine S seconds into the run and starts it
again on the same port (a new process: its KV cache is empty), then `recovery` reports
the hit ratio of the requests before it and of each window of requests after it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any, cast

import aiohttp

from bench.harness.cluster import (
    Cluster,
    RouterOptions,
    peer_router_command,
    router_command,
    router_toml,
    scrape,
)
from bench.harness.modes import EXTERNAL_MODES, OUR_MODES, SMG_MODES
from bench.harness.procs import Proc, RSSSampler, free_ports, pinned, wait_http


async def start_replicas(
    cluster: Cluster, mode: str, n: int, opts: RouterOptions, work_dir: Path, cores: list[int] | None = None
) -> list[str]:
    """N routers of `mode` in front of the cluster's engines; their URLs. The first is also
    `cluster.router` / `cluster.url` (its log is logs/router.log, the others router-<i>.log)."""
    work_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any traffic
    urls, procs, health = [], [], []
    for i in range(n):
        name = "router" if i == 0 else f"router-{i}"
        if mode in OUR_MODES:
            port = free_ports(1)[0]
            cfg = work_dir / f"{name}.toml"
            cfg.write_text(
                router_toml(
                    port,
                    cluster.decoders,
                    cluster.prefillers,
                    opts,
                    cluster.kv_events,
                    cluster.data_parallel_size,
                    cluster.decoders_prefill,
                )
            )
            cmd = [*router_command(), "--config", str(cfg), "--no-engines"]
            kind, ready = "ours", "/ready"
        elif mode in EXTERNAL_MODES or mode in SMG_MODES:
            port, prom = free_ports(2)
            vllm = mode in EXTERNAL_MODES
            policy = (EXTERNAL_MODES if vllm else SMG_MODES)[mode]
            cmd = peer_router_command("vllm-router" if vllm else "smg", policy, port, prom, cluster.decoders)
            kind, ready = ("vllm-router" if vllm else "smg"), "/health"
        else:
            raise SystemExit(f"--routers: mode {mode!r} has no router to replicate")
        proc = cluster.procs.start(name, pinned(cmd, cores))
        procs.append(proc)
        urls.append(f"http://127.0.0.1:{port}")
        health.append(wait_http(urls[-1] + ready, proc, 90))
    await asyncio.gather(*health)
    cluster.router, cluster.router_kind, cluster.url = procs[0], kind, urls[0]
    cluster.replicas = procs
    return urls


class Samplers:
    """CPU time (summed) and peak RSS (the largest) of every router replica."""

    def __init__(self, procs: list[Proc]):
        self.samplers = [RSSSampler(p.pid) for p in procs]

    def start(self) -> None:
        for s in self.samplers:
            s.start()

    async def stop(self) -> tuple[float, int]:
        got = [await s.stop() for s in self.samplers]
        return sum(c for c, _ in got), max(r for _, r in got)


async def restart_engine_at(cluster: Cluster, delay_s: float, engine: int = 0) -> dict[str, Any]:
    """After `delay_s`, stop decode engine `engine` and start it again on the same port
    with an empty cache; returns when (run-relative seconds) it went down and came back."""
    t0 = time.monotonic()
    await asyncio.sleep(delay_s)
    url = cluster.decoders[engine]
    proc = cluster._owners[engine]
    if sum(p is proc for p in cluster._owners) > 1:
        raise SystemExit("--restart-engine-at needs one engine per process (--engines-per-process 1)")
    cmd = list(cast("list[str]", proc.popen.args))  # ProcessSet.start passes a list
    down = time.monotonic() - t0
    cluster.procs.stop(proc, grace_s=2.0)
    new = cluster.procs.start(f"{proc.name}-restarted", cmd)
    cluster._owners[engine] = new
    await wait_http(url + "/health", new, 60)
    print(
        f"  engine {url} restarted at {down:.1f} s (back after {time.monotonic() - t0 - down:.1f} s)", file=sys.stderr
    )
    return {"engine": url, "down_at_s": round(down, 3), "up_at_s": round(time.monotonic() - t0, 3)}


async def slow_engine_at(cluster: Cluster, delay_s: float, factor: float, engine: int = 0) -> dict[str, Any]:
    """After `delay_s`, make decode engine `engine`'s steps `factor` times as long (the
    simulator's slowdown fault; its engines started with --enable-admin)."""
    await asyncio.sleep(delay_s)
    url = cluster.decoders[engine]
    async with aiohttp.ClientSession() as s, s.post(url + "/_sim/faults", json={"slowdown": factor}) as r:
        r.raise_for_status()
        faults = await r.json()
    print(f"  engine {url} slowed {factor:g}x at {delay_s:.1f} s", file=sys.stderr)
    return {"engine": url, "slowed_at_s": delay_s, "slowdown": faults["slowdown"]}  # as the engine took it


def recovery(rows: list[dict[str, Any]], restart_s: float, window: int = 25, windows: int = 6) -> dict[str, Any]:
    """Hit ratio (cached prompt tokens reported to the client over prompt tokens; a request
    that went prefill/decode counts as computed) of the 100 requests sent before the
    restart and of each `window` requests sent after it, in send order."""

    def ratio(rs: list[dict[str, Any]]) -> float | None:
        prompt = sum(r.get("expected_prompt_tokens") or 0 for r in rs)
        hit = sum((r.get("cached_tokens") or 0) for r in rs if r.get("route") != "pd")
        return round(hit / prompt, 4) if prompt else None

    ordered = sorted((r for r in rows if r.get("status") == 200), key=lambda r: r["start_s"])
    before = [r for r in ordered if r["start_s"] < restart_s][-100:]
    after = [r for r in ordered if r["start_s"] >= restart_s]
    return {
        "restart_at_s": restart_s,
        "before_100": ratio(before),
        "window": window,
        "after": [ratio(after[i : i + window]) for i in range(0, min(len(after), window * windows), window)],
    }


async def scrape_all(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, list[tuple[dict[str, Any], float]]]:
    """Every replica's /metrics as one page: the samples side by side, so sums (counters,
    histogram buckets) are the fleet's."""
    merged: dict[str, list[tuple[dict[str, Any], float]]] = {}
    for page in await asyncio.gather(*(scrape(session, u) for u in urls)):
        for name, samples in page.items():
            merged.setdefault(name, []).extend(samples)
    return merged
