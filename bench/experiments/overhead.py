"""`python -m bench overhead`: what the router adds over a backend that answers at once.

Targets, all in front of the same instant backend (`bench.harness.instant_backend`, 32-chunk
streams in vLLM's shape), all started once and measured in interleaved repetitions
(rep 1: every target, rep 2: every target, ...; the median over repetitions is reported):

- `direct`: the backend itself (the reference every "added" figure subtracts);
- `passthrough`: a minimal aiohttp + uvloop proxy (`bench.harness.passthrough`), the floor;
- `router_round_robin`, `router_least_loaded`: our router, direct routing;
- `router_round_robin_quiet`: the same with `server.log_level = "warning"` (no per-request log line);
- `router_probe_k1`: our router in probe mode with one engine (the race always streams upstream);
- `vllm_router_rr`: vllm-router `--policy round_robin`, if installed.

Measurements per target and repetition:
- latency: sequential requests on one keep-alive connection from a blocking-socket client
  (tiny client overhead, same for every target): p50/p99 of the whole answer, non-streaming
  and streaming (32 chunks), and time to the first body byte of the stream;
- throughput: `wrk -t1 -c64` for `--duration` seconds with a small non-streaming request;
  requests/s and the target's CPU seconds per request (psutil on its PID).
Placement: with 2+ cores, every proxy is pinned to the last core, and the backend, wrk and
this process to the others (taskset), so the proxy under test has one core to itself.

The probe race's own cost: our router in probe mode with K = 2, 4, 8 backends (all accept at
once, so every request has K - 1 losers to cancel): latency and CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.harness.cluster import RouterOptions, router_command, router_toml
from bench.harness.load_clients import SMALL, measure_latency, run_wrk
from bench.harness.procs import PY, Proc, ProcessSet, RSSSampler, cpu_list, free_ports, pinned, split_cores, wait_http
from bench.harness.stats import median, rnd
from bench.reports.render import bar_plot, console, markdown_table, table


class Target:
    def __init__(self, name: str, port: int, proc: Proc | None = None):
        self.name, self.port, self.proc = name, port, proc
        self.samples: list[dict[str, Any]] = []


async def start_targets(
    procs: ProcessSet, backend_urls: list[str], names: list[str], proxy_cores: list[int] | None, work: Path
) -> list[Target]:
    targets = []
    up = backend_urls[0]
    for name in names:
        if name == "direct":
            targets.append(Target(name, int(up.rsplit(":", 1)[1])))
            continue
        port = free_ports(1)[0]
        if name == "passthrough":
            proc = procs.start(
                name,
                pinned([PY, "-m", "bench.harness.passthrough", "--port", str(port), "--upstream", up], proxy_cores),
            )
            await wait_http(f"http://127.0.0.1:{port}/health", proc, 30)
        elif name.startswith("router_"):
            strategy, log_level, k = "round_robin", "info", 1
            if name.startswith("router_probe_k"):
                strategy, k = "probe", int(name.rsplit("k", 1)[1])
            elif name.startswith("router_least_loaded"):
                strategy = "least_loaded"
            if name.endswith("_quiet"):
                log_level = "warning"
            opts = RouterOptions(strategy=strategy, log_level=log_level, threshold=0.5, probe_deadline_ms=1000.0)
            cfg = work / f"{name}.toml"
            urls = [backend_urls[i % len(backend_urls)] for i in range(k)]
            cfg.write_text(router_toml(port, urls, [], opts))
            proc = procs.start(name, pinned([*router_command(), "--config", str(cfg), "--no-engines"], proxy_cores))
            await wait_http(f"http://127.0.0.1:{port}/ready", proc, 30)
        elif name.startswith("vllm_router"):
            exe = shutil.which("vllm-router", path=str(Path(PY).parent)) or shutil.which("vllm-router")
            if exe is None:  # main drops only the default vllm_router_rr when it is missing
                raise SystemExit(f"overhead target {name!r} needs vllm-router, which is not installed")
            policy = "cache_aware" if name.endswith("cache_aware") else "round_robin"
            prom = free_ports(1)[0]
            proc = procs.start(
                name,
                pinned(
                    [
                        exe,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--worker-urls",
                        up,
                        "--policy",
                        policy,
                        "--prometheus-port",
                        str(prom),
                        "--log-level",
                        "warning",
                    ],
                    proxy_cores,
                ),
            )
            await wait_http(f"http://127.0.0.1:{port}/health", proc, 60)
        else:
            raise SystemExit(f"unknown overhead target {name!r}")
        targets.append(Target(name, port, proc))
    return targets


def cpu_of(t: Target) -> RSSSampler | None:
    return RSSSampler(t.proc.pid) if t.proc is not None else None


def backend_counts(port: int) -> tuple[int, int]:
    """(connections accepted, requests answered) so far by the instant backend on `port`."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return 0, 0
    c = re.search(r"^instant_backend_connections_total (\d+)", text, re.M)
    r = re.search(r"^instant_backend_requests_total (\d+)", text, re.M)
    return (int(c.group(1)) if c else 0), (int(r.group(1)) if r else 0)


def measure_target(
    t: Target, a: argparse.Namespace, cores_other: list[int] | None, tmp: Path, backend_port: int | None = None
) -> dict[str, Any]:
    s: dict[str, Any] = {}
    lat = measure_latency(t.port, "/v1/completions", SMALL, a.latency_requests)
    s.update({"lat_p50_us": lat["p50_us"], "lat_p99_us": lat["p99_us"], "lat_errors": lat["errors"]})
    lat_s = measure_latency(t.port, "/v1/completions", {**SMALL, "stream": True}, a.latency_requests)
    s.update(
        {
            "stream_p50_us": lat_s["p50_us"],
            "stream_p99_us": lat_s["p99_us"],
            "stream_first_p50_us": lat_s["first_p50_us"],
            "stream_errors": lat_s["errors"],
        }
    )
    sampler = cpu_of(t)
    c0, r0 = backend_counts(backend_port) if backend_port else (0, 0)
    w = run_wrk(t.port, SMALL, a.connections, a.duration, cores_other, tmp)
    cpu = sampler.cpu_s() - sampler.cpu0 if sampler else None
    c1, r1 = backend_counts(backend_port) if backend_port else (0, 0)
    if r1 > r0:
        s["upstream_conns_per_1k"] = (c1 - c0) / (r1 - r0) * 1000
    s.update(
        {
            "rps": w["rps"],
            "wrk_requests": w["requests"],
            "wrk_non2xx": w["non2xx"],
            "wrk_socket_errors": w["socket_errors"],
            "cpu_us_per_req": (cpu / w["requests"] * 1e6) if cpu is not None and w["requests"] else None,
        }
    )
    if w["raw"]:
        s["wrk_output"] = w["raw"][-500:]
    return s


def summarize_target(t: Target, direct: dict[str, Any] | None) -> dict[str, Any]:
    keys = [
        "lat_p50_us",
        "lat_p99_us",
        "stream_p50_us",
        "stream_p99_us",
        "stream_first_p50_us",
        "rps",
        "cpu_us_per_req",
        "upstream_conns_per_1k",
    ]
    out = {"target": t.name, "reps": len(t.samples)}
    for k in keys:
        out[k] = rnd(median([s[k] for s in t.samples if s.get(k) is not None]), 1)
    out["errors"] = sum(
        s.get("lat_errors", 0) + s.get("stream_errors", 0) + s.get("wrk_non2xx", 0) + s.get("wrk_socket_errors", 0)
        for s in t.samples
    )
    if direct is not None and t.name != "direct":
        for k in ("lat_p50_us", "lat_p99_us", "stream_p50_us", "stream_first_p50_us"):
            if out.get(k) is not None and direct.get(k) is not None:
                out["added_" + k] = rnd(out[k] - direct[k], 1)
    return out


def main(a: argparse.Namespace) -> int:
    if a.streams:  # CPU per streamed request and chunk: bench/experiments/stream_cpu.py
        from bench.experiments.stream_cpu import main as streams_main

        return streams_main(a)
    if a.quick:
        a.reps, a.duration, a.latency_requests = 1, 2.0, 200
    if not shutil.which("wrk"):
        console.print("[red]wrk is not installed (apt-get install -y wrk); throughput is skipped[/red]")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = cpu_list()
    proxy_cores, other_cores = split_cores(a.no_pin)
    own = os.sched_getaffinity(0)
    names = [
        n
        for n in (
            a.targets.split(",")
            if a.targets
            else [
                "direct",
                "passthrough",
                "router_round_robin",
                "router_least_loaded",
                "router_round_robin_quiet",
                "router_probe_k1",
                "vllm_router_rr",
            ]
        )
        if n
    ]
    if "vllm_router_rr" in names and not (
        shutil.which("vllm-router", path=str(Path(PY).parent)) or shutil.which("vllm-router")
    ):
        names.remove("vllm_router_rr")
    ks = [int(k) for k in a.probe_k.split(",") if k]
    result: dict[str, Any] = {
        "machine": {"cpus": len(cores), "pinned": proxy_cores is not None, "loadavg_before": os.getloadavg()},
        "connections": a.connections,
        "duration_s": a.duration,
        "reps": a.reps,
        "latency_requests": a.latency_requests,
    }
    with tempfile.TemporaryDirectory() as tmpd, ProcessSet(out / "logs") as procs:
        tmp = Path(tmpd)
        nports = max([8, *ks])
        bports = free_ports(nports)
        backend = procs.start(
            "instant_backend",
            pinned(
                [
                    PY,
                    "-m",
                    "bench.harness.instant_backend",
                    *(arg for p in bports for arg in ("--port", str(p))),
                    "--chunks",
                    "32",
                ],
                other_cores,
            ),
        )
        burls = [f"http://127.0.0.1:{p}" for p in bports]
        asyncio.run(_wait_all(burls, backend))
        targets = asyncio.run(start_targets(procs, burls, names, proxy_cores, tmp))
        if other_cores is not None:  # set exactly when pinning
            os.sched_setaffinity(0, other_cores)
        try:
            for rep in range(a.reps):
                for t in targets:
                    console.print(f"rep {rep + 1}/{a.reps}: {t.name}")
                    t.samples.append(measure_target(t, a, other_cores, tmp, bports[0]))
            direct = next((summarize_target(t, None) for t in targets if t.name == "direct"), None)
            rows = [summarize_target(t, direct) for t in targets]
            floor = next((r for r in rows if r["target"] == "passthrough"), None)
            for r in rows:
                if floor and r.get("added_lat_p50_us") is not None and floor.get("added_lat_p50_us"):
                    r["added_vs_passthrough"] = rnd(r["added_lat_p50_us"] / floor["added_lat_p50_us"], 2)
                if floor and r.get("cpu_us_per_req") is not None and floor.get("cpu_us_per_req"):
                    r["cpu_vs_passthrough"] = rnd(r["cpu_us_per_req"] / floor["cpu_us_per_req"], 2)
                if floor and r.get("added_stream_p50_us") is not None and floor.get("added_stream_p50_us"):
                    r["stream_added_vs_passthrough"] = rnd(r["added_stream_p50_us"] / floor["added_stream_p50_us"], 2)
            result["targets"] = rows
            result["samples"] = {t.name: t.samples for t in targets}
            # Probe race cost as K grows.
            probe_rows: list[dict[str, Any]] = []
            for k in ks:
                name = f"router_probe_k{k}"
                [t] = asyncio.run(start_targets(procs, burls, [name], proxy_cores, tmp))
                assert t.proc is not None  # a router target always runs its own process
                samples = []
                for _ in range(a.reps):
                    lat = measure_latency(t.port, "/v1/completions", SMALL, a.latency_requests)
                    sampler = RSSSampler(t.proc.pid)
                    w = run_wrk(t.port, SMALL, min(16, a.connections), max(2.0, a.duration / 2), other_cores, tmp)
                    cpu = sampler.cpu_s() - sampler.cpu0
                    samples.append(
                        {
                            "lat_p50_us": lat["p50_us"],
                            "lat_p99_us": lat["p99_us"],
                            "rps": w["rps"],
                            "cpu_us_per_req": cpu / w["requests"] * 1e6 if w["requests"] else None,
                            "errors": lat["errors"] + w["non2xx"] + w["socket_errors"],
                        }
                    )
                row: dict[str, Any] = {"k": k}
                for key in ("lat_p50_us", "lat_p99_us", "rps", "cpu_us_per_req"):
                    row[key] = rnd(median([s[key] for s in samples if s.get(key) is not None]), 1)
                row["errors"] = sum(s["errors"] for s in samples)
                if direct and row["lat_p50_us"] is not None:
                    row["added_lat_p50_us"] = rnd(row["lat_p50_us"] - direct["lat_p50_us"], 1)
                probe_rows.append(row)
                procs.stop(t.proc)
            k1 = next((r for r in rows if r["target"] == "router_probe_k1"), None)
            if k1:
                probe_rows.insert(
                    0,
                    {
                        "k": 1,
                        **{
                            k: k1.get(k)
                            for k in ("lat_p50_us", "lat_p99_us", "rps", "cpu_us_per_req", "added_lat_p50_us")
                        },
                        "errors": k1.get("errors"),
                    },
                )
            result["probe_race"] = probe_rows
        finally:
            os.sched_setaffinity(0, own)
    result["machine"]["loadavg_after"] = os.getloadavg()
    (out / "overhead.json").write_text(json.dumps(result, indent=2))
    cols = [
        ("target", "target"),
        ("lat_p50_us", "p50 us"),
        ("added_lat_p50_us", "added p50 us"),
        ("added_vs_passthrough", "x passthrough"),
        ("lat_p99_us", "p99 us"),
        ("added_lat_p99_us", "added p99 us"),
        ("stream_p50_us", "stream p50 us"),
        ("added_stream_p50_us", "stream added p50 us"),
        ("stream_added_vs_passthrough", "stream x passthrough"),
        ("added_stream_first_p50_us", "stream first-byte added us"),
        ("rps", f"req/s @{a.connections}"),
        ("cpu_us_per_req", "CPU us/req"),
        ("cpu_vs_passthrough", "CPU x passthrough"),
        ("upstream_conns_per_1k", "new upstream conns/1k"),
        ("errors", "errors"),
    ]
    nd = {"added_vs_passthrough": 2, "stream_added_vs_passthrough": 2, "cpu_vs_passthrough": 2}
    console.print(
        table("Router overhead (instant backend, medians of interleaved repetitions)", cols, result["targets"], nd)
    )
    pcols = [
        ("k", "K engines"),
        ("lat_p50_us", "p50 us"),
        ("added_lat_p50_us", "added p50 us"),
        ("lat_p99_us", "p99 us"),
        ("rps", "req/s @16"),
        ("cpu_us_per_req", "CPU us/req"),
        ("errors", "errors"),
    ]
    console.print(
        table("Probe race cost (all K accept; K-1 losers cancelled per request)", pcols, result["probe_race"])
    )
    (out / "overhead.md").write_text(
        markdown_table(cols, result["targets"], nd) + "\n\n" + markdown_table(pcols, result["probe_race"]) + "\n"
    )
    rows = [r for r in result["targets"] if r["target"] != "direct"]
    bar_plot(
        out / "overhead_added_latency.png",
        [r["target"] for r in rows],
        [r.get("added_lat_p50_us") or 0 for r in rows],
        "added latency p50 (us)",
        "Added latency, non-streaming, 1 connection",
    )
    bar_plot(
        out / "overhead_rps.png",
        [r["target"] for r in result["targets"]],
        [r.get("rps") or 0 for r in result["targets"]],
        f"requests/s at {a.connections} connections",
        "Maximum throughput, small non-streaming requests",
    )
    return 0


async def _wait_all(urls: list[str], proc: Proc) -> None:
    await asyncio.gather(*(wait_http(u + "/health", proc, 30) for u in urls))
