"""`python -m bench fairness`: does a tenant at its limits raise another tenant's TTFT?

Simulated engines and `router --config` run as processes. Two keys: `victim` (a steady
closed loop of `--victim-clients` streams) and `flood` (`[[tenants]]` with
`max_concurrent_requests = --flood-limit`). Phases of `--phase-s` seconds each, the
victim's load the same in all:

  alone             the victim only
  flood_at_limit    + flood with exactly --flood-limit clients (what its limit lets run)
  flood_over_limit  + flood with --flood-clients clients (far over its limit: they queue)
  no_tenant_limits  the same flood against a router where both keys are plain
                    server.api_keys (no per-key limit): what fair sharing prevents

Printed (and written to `--out`/fairness.json): the victim's TTFT p50/p99 per phase, and
the target figure: p99(flood_over_limit) / p99(flood_at_limit) <= 1.10, i.e. a tenant
pushing past its limit does not make another tenant wait longer than the limit itself does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import tomli_w

from bench.harness.procs import PY, ProcessSet, free_ports, wait_http
from bench.harness.stats import percentile, rnd

REPO = Path(__file__).resolve().parents[2]
MODEL = "sim-model"
VICTIM_KEY, FLOOD_KEY = "bench-victim-key", "bench-flood-key"


async def _ttft_ms(s: aiohttp.ClientSession, url: str, key: str, i: int, max_tokens: int) -> float | None:
    """One streamed request; the time to its first text chunk (None if it failed)."""
    body = orjson.dumps(
        {
            "model": MODEL,
            "prompt": f"tenant {key[-10:]} request {i} " + "w " * 32,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    )
    t0 = time.perf_counter()
    async with s.post(
        url + "/v1/completions",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    ) as r:
        if r.status != 200:
            await r.read()
            return None
        ttft = None
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {") and b'"text":"' in line and b'"text":""' not in line:
                ttft = (time.perf_counter() - t0) * 1000.0
        return ttft


async def _closed_loop(url: str, key: str, clients: int, until: float, max_tokens: int, out: list[float] | None) -> int:
    """`clients` loops sending one request after the other until `until`; TTFTs into `out`."""
    failed = 0
    counter = iter(range(10**9))
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def loop() -> None:
            nonlocal failed
            while time.monotonic() < until:
                t = await _ttft_ms(s, url, key, next(counter), max_tokens)
                if t is None:
                    failed += 1
                elif out is not None:
                    out.append(t)

        await asyncio.gather(*(loop() for _ in range(clients)))
    return failed


async def _flood(url: str, clients: int, seconds: float, max_tokens: int) -> int:
    """The flood in a process of its own, so that its clients do not slow down the
    victim's clock-keeping event loop; the number of its requests that failed."""
    proc = await asyncio.create_subprocess_exec(
        PY,
        "-m",
        "bench.experiments.fairness",
        "--flood-worker",
        url,
        str(clients),
        str(seconds),
        str(max_tokens),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    return int(out.strip() or -1)


async def _phase(url: str, a: argparse.Namespace, flood_clients: int) -> dict[str, Any]:
    until = time.monotonic() + a.phase_s
    victim: list[float] = []
    jobs = [_closed_loop(url, VICTIM_KEY, a.victim_clients, until, a.max_tokens, victim)]
    if flood_clients:
        jobs.append(_flood(url, flood_clients, a.phase_s, a.max_tokens))
    failed = await asyncio.gather(*jobs)
    return {
        "victim_requests": len(victim),
        "victim_failed": failed[0],
        "flood_failed": failed[1] if flood_clients else 0,
        "victim_ttft_p50_ms": rnd(percentile(victim, 50), 1),
        "victim_ttft_p99_ms": rnd(percentile(victim, 99), 1),
    }


def _router_config(port: int, engines: list[tuple[str, int]], a: argparse.Namespace, tenants: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "server": {
            "port": port,
            "host": "127.0.0.1",
            "max_concurrent_requests": a.router_slots,
            "max_queued_requests": 4096,
            "queue_timeout_s": 120.0,
            "log_level": "warning",
        },
        "backends": [
            {"name": n, "url": f"http://127.0.0.1:{p}", "role": "decode", "models": [MODEL]} for n, p in engines
        ],
    }
    if tenants:
        cfg["tenants"] = [
            {"name": "victim", "api_key": VICTIM_KEY},
            {
                "name": "flood",
                "api_key": FLOOD_KEY,
                "max_concurrent_requests": a.flood_limit,
                "max_queued_requests": a.flood_clients,
            },
        ]
    else:
        cfg["server"]["api_keys"] = [VICTIM_KEY, FLOOD_KEY]
    return cfg


async def run(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    ports = free_ports(a.engines + 1)
    phases: dict[str, dict[str, Any]] = {}
    with ProcessSet(out / "logs") as ps:
        engines = [(f"d{i}", ports[i]) for i in range(a.engines)]
        for n, p in engines:
            proc = ps.start(
                n,
                [
                    PY,
                    "-m",
                    "engine_launcher.sim",
                    "--port",
                    str(p),
                    "--model",
                    MODEL,
                    "--speed",
                    str(a.speed),
                    "--log-level",
                    "warning",
                ],
            )
            await wait_http(f"http://127.0.0.1:{p}/health", proc)
        rport = ports[-1]
        for tenants in (True, False):
            name = "router" if tenants else "router-no-tenants"
            (out / f"{name}.toml").write_text(tomli_w.dumps(_router_config(rport, engines, a, tenants)))
            router = ps.start(name, [PY, "-m", "router.cli", "--config", str(out / f"{name}.toml"), "--no-engines"])
            url = f"http://127.0.0.1:{rport}"
            await wait_http(url + "/ready", router)
            plan = (
                [("alone", 0), ("flood_at_limit", a.flood_limit), ("flood_over_limit", a.flood_clients)]
                if tenants
                else [("no_tenant_limits", a.flood_clients)]
            )
            for phase, flood in plan:
                phases[phase] = await _phase(url, a, flood)
                print(f"{phase:18s} {phases[phase]}", flush=True)
            ps.stop(router)
    at, over = phases["flood_at_limit"]["victim_ttft_p99_ms"], phases["flood_over_limit"]["victim_ttft_p99_ms"]
    return {
        "config": vars(a),
        "phases": phases,
        "p99_over_limit_vs_at_limit": rnd(over / at, 3) if at and over else None,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--flood-worker"]:
        url, clients, seconds, max_tokens = argv[1], int(argv[2]), float(argv[3]), int(argv[4])
        print(asyncio.run(_closed_loop(url, FLOOD_KEY, clients, time.monotonic() + seconds, max_tokens, None)))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--speed", type=float, default=1.0, help="simulator speed factor")
    p.add_argument("--router-slots", type=int, default=16, help="server.max_concurrent_requests")
    p.add_argument("--victim-clients", type=int, default=4)
    p.add_argument("--flood-limit", type=int, default=8, help="the flood tenant's max_concurrent_requests")
    p.add_argument("--flood-clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", help="output directory (default bench/out/fairness-<UTC time>)")
    a = p.parse_args(argv)
    out = Path(a.out or REPO / "bench" / "out" / time.strftime("fairness-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    res = asyncio.run(run(a, out))
    (out / "fairness.json").write_text(json.dumps(res, indent=2))
    print(
        f"victim TTFT p99, flood over its limit / flood at its limit: {res['p99_over_limit_vs_at_limit']} "
        "(target <= 1.10)"
    )
    print(f"results in {out}/fairness.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
