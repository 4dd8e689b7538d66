"""The targets of the streamed-request benchmarks and the load they receive.

`bench overhead --streams` (bench/experiments/stream_cpu.py) and `bench stream-instructions`
(bench/experiments/stream_instructions.py) put the same targets in front of the same instant
backend: the aiohttp pass-through floor, modes of this router (and their `@base` twins from
another checkout), vllm-router; and send them the same streamed requests.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.harness.cluster import RouterOptions, router_toml
from bench.harness.procs import PY, Proc, ProcessSet, free_ports, pinned, wait_http

REPO = Path(__file__).resolve().parents[2]
# The router is started as `python -m router` with this checkout first on the path (the
# installed `router` script may import another copy).
ENV = {"PYTHONPATH": str(REPO)}

# target name -> (strategy, engines in the race, extra [routing] keys)
ROUTER_MODES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "router_round_robin": ("round_robin", 1, {}),
    "router_least_loaded": ("least_loaded", 1, {}),
    "router_prefix_tree": ("prefix_tree", 1, {}),
    "router_kv_events": ("kv_events", 1, {}),
    "router_probe_k1": ("probe", 1, {"race": "always"}),
    "router_probe_k4": ("probe", 4, {"race": "always"}),
}
DEFAULT_TARGETS = ["passthrough", *ROUTER_MODES, "vllm_router_rr"]
SHAPES = {"instant": None, "paced": "pace_ms=1;burst=1", "burst": "pace_ms=8;burst=8"}


def vllm_router_exe() -> str | None:
    return shutil.which("vllm-router", path=str(Path(PY).parent)) or shutil.which("vllm-router")


def router_cmd(cfg: Path, profile_out: Path | None = None) -> list[str]:
    prof = ["-m", "bench.harness.profiled", str(profile_out)] if profile_out is not None else []
    return [PY, *prof, "-m", "router", "--config", str(cfg), "--no-engines"]


BASE = "@base"  # a target's twin started from --base-checkout


async def start_target(
    procs: ProcessSet,
    name: str,
    urls: list[str],
    cores: list[int] | None,
    work: Path,
    profile: Path | None = None,
    base_checkout: Path | None = None,
    wrap: Sequence[str] = (),
) -> tuple[int, Proc]:
    """Start target `name` on a free port (`wrap`: a command it runs under, e.g. valgrind)."""
    port = free_ports(1)[0]
    slow = 10 if wrap else 1  # a start under valgrind takes that much longer
    mode, twin, rest = name.partition(BASE)
    if twin and (base_checkout is None or mode not in ROUTER_MODES or rest):
        raise SystemExit(f"stream target {name!r}: only a router mode has a twin, with --base-checkout")
    if name == "passthrough":
        proc = procs.start(
            name,
            pinned([*wrap, PY, "-m", "bench.harness.passthrough", "--port", str(port), "--upstream", urls[0]], cores),
            ENV,
        )
        await wait_http(f"http://127.0.0.1:{port}/health", proc, 600 if wrap else 30)
    elif mode in ROUTER_MODES:
        cfg = work / f"{name}.toml"
        cfg.write_text(router_toml(port, urls[: ROUTER_MODES[mode][1]], [], _router_options(mode)))
        if twin:  # PYTHONSAFEPATH: `python -m` would put the working directory (this checkout) first
            cmd = pinned([*wrap, *router_cmd(cfg)], cores)
            proc = procs.start(name, cmd, {"PYTHONSAFEPATH": "1"}, root=str(base_checkout))
        else:
            proc = procs.start(name, pinned([*wrap, *router_cmd(cfg, profile)], cores), ENV)
        await wait_http(f"http://127.0.0.1:{port}/ready", proc, 60 * slow)
    elif name == "vllm_router_rr":
        exe = vllm_router_exe()
        if exe is None:
            raise SystemExit("vllm_router_rr needs vllm-router, which is not installed")
        prom = str(free_ports(1)[0])
        cmd = [*wrap, exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", urls[0]]
        cmd += ["--policy", "round_robin", "--prometheus-port", prom, "--log-level", "warning"]
        proc = procs.start(name, pinned(cmd, cores))
        await wait_http(f"http://127.0.0.1:{port}/health", proc, 60 * slow)
    else:
        raise SystemExit(f"unknown stream target {name!r}")
    return port, proc


def _router_options(mode: str) -> RouterOptions:
    strategy, _k, extra = ROUTER_MODES[mode]
    return RouterOptions(
        strategy=strategy, log_level="info", threshold=0.5, probe_deadline_ms=1000.0, extra_routing=extra
    )


def request_bytes(port: int, chunks: int, pace: str | None) -> bytes:
    body: dict[str, Any] = {"model": "sim-model", "prompt": list(range(1, 33)), "max_tokens": chunks, "stream": True}
    if pace is not None:
        body["user"] = pace
    data = orjson.dumps(body)
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (port, len(data), data)
    )


async def read_answer(reader: asyncio.StreamReader) -> int:
    """One streamed answer; returns its `data:` events (0 for anything but a 200 ending in [DONE])."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_ok = head.startswith(b"HTTP/1.1 200")
    lower = head.lower()
    if b"content-length:" in lower:
        i = lower.index(b"content-length:") + 15
        body = await reader.readexactly(int(lower[i : lower.index(b"\r\n", i)]))
    else:  # chunked: the last frame is `0\r\n\r\n`
        parts = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            parts.append(await reader.readexactly(size + 2))
        body = b"".join(parts)
    if not status_ok or b"data: [DONE]" not in body:
        return 0
    return body.count(b"data: ")


async def client_load(port: int, chunks: int, pace: str | None, requests: int, concurrency: int) -> int:
    """Send `requests` streamed requests over `concurrency` keep-alive connections; errors."""
    req = request_bytes(port, chunks, pace)
    left = requests
    errors = 0

    async def one_connection() -> None:
        nonlocal left, errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        try:
            while left > 0:
                left -= 1
                writer.write(req)
                if await read_answer(reader) < chunks:
                    errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(one_connection() for _ in range(concurrency)))
    return errors
