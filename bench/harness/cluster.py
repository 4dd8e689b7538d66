"""A simulated cluster as subprocesses: K decode engines, P prefill engines, and a router
in front (ours with a generated TOML, vllm-router, or none), with metric scraping. Engines
of one role share a process (`python -m engine_launcher.sim --port A --port B`) by
`engines_per_process`; the router is its own, its CPU and memory measured from outside.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import tomli_w
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.procs import PY, Proc, ProcessSet, free_port_run, free_ports, pinned, wait_http
from router.config.schema import RoutingConfig, ServerConfig
from router.routing.policies import POLICIES
from router.routing.policies.probe import ProbeSettings

_ROUTING = RoutingConfig()
_PROBE = ProbeSettings()
_SERVER = ServerConfig()

MODEL = "sim-model"
SCRAPE_INTERVAL_S = 0.5  # of /metrics in bench runs (the router's default is 1 s)


@dataclass
class SimOptions:
    """Flags of every simulated engine (see `python -m engine_launcher.sim --help`)."""

    speed: float = 1.0
    block_size: int = 16
    num_gpu_blocks: int = 28000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192  # lowered to what the KV cache holds, as the simulator requires
    prefill_token_s: float | None = None
    kv_transfer_token_s: float | None = None
    # CPU tier of each engine, as a multiple of its GPU KV capacity (0: none), and its load cost.
    cpu_offload_x: float = 0.0
    cpu_load_token_s: float | None = None
    arrival_check: bool = True
    seed: int = 0
    # Decode servers' DP ranks (vLLM --data-parallel-size): KV caches behind each decode port.
    data_parallel_size: int = 1
    extra: tuple[str, ...] = ()

    def args(self) -> list[str]:
        a = [
            "--model",
            MODEL,
            "--speed",
            repr(self.speed),
            "--block-size",
            str(self.block_size),
            "--num-gpu-blocks",
            str(self.num_gpu_blocks),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--max-model-len",
            str(min(self.max_model_len, (self.num_gpu_blocks - 1) * self.block_size)),
            "--seed",
            str(self.seed),
            "--arrival-check" if self.arrival_check else "--no-arrival-check",
            "--log-level",
            "warning",
        ]
        if self.prefill_token_s is not None:
            a += ["--prefill-token-s", repr(self.prefill_token_s)]
        if self.kv_transfer_token_s is not None:
            a += ["--kv-transfer-token-s", repr(self.kv_transfer_token_s)]
        if self.cpu_offload_x > 0:
            gpu_tokens = (self.num_gpu_blocks - 1) * self.block_size
            a += ["--cpu-offload-tokens", str(round(self.cpu_offload_x * gpu_tokens))]
            if self.cpu_load_token_s is not None:
                a += ["--cpu-load-token-s", repr(self.cpu_load_token_s)]
        return a + list(self.extra)


@dataclass
class RouterOptions:
    """The routing keys a bench run sets; defaults are the router's own."""

    strategy: str = _ROUTING.strategy
    threshold: float = _PROBE.cache_hit_threshold
    probe_deadline_ms: float = _PROBE.probe_deadline_ms
    min_pd_prompt_tokens: int = _ROUTING.min_pd_prompt_tokens
    decode_guard_threshold: float = _ROUTING.decode_guard_threshold
    max_probe_waiting: int = _PROBE.max_probe_waiting
    max_probes: int = _PROBE.max_probes
    log_level: str = _SERVER.log_level
    # Far above the router's defaults: a bench measures routing, not admission control.
    max_concurrent_requests: int = 4096
    max_queued_requests: int = 4096
    # Declare DP ranks (backends[].data_parallel_size); False: one engine per server.
    declare_data_parallel: bool = True
    extra_routing: dict[str, Any] = field(default_factory=dict[str, Any])
    extra_server: dict[str, Any] = field(default_factory=dict[str, Any])


def reads_index(strategy: str) -> bool:
    """Does the policy match prompts against the KV-event index (then the router subscribes)?"""
    policy = POLICIES.get(strategy)
    return bool(policy is not None and policy.reads_index)


def router_toml(
    port: int,
    decoders: list[str],
    prefillers: list[str],
    opts: RouterOptions,
    kv_events: dict[str, tuple[str, str]] | None = None,
    data_parallel_size: int = 1,
    decoders_prefill: bool = False,  # the decoders are producers too (role "both")
) -> str:
    """`kv_events`: engine URL -> (event endpoint, replay endpoint), subscribed to when the
    strategy reads the index (only then: the others would pay for an index they ignore)."""
    routing = {
        "strategy": opts.strategy,
        "cache_hit_threshold": float(opts.threshold),
        "probe_deadline_ms": float(opts.probe_deadline_ms),
        "min_pd_prompt_tokens": int(opts.min_pd_prompt_tokens),
        "decode_guard_threshold": float(opts.decode_guard_threshold),
        "max_probe_waiting": int(opts.max_probe_waiting),
        "max_probes": int(opts.max_probes),
        **opts.extra_routing,
    }
    dp = {"data_parallel_size": data_parallel_size} if data_parallel_size > 1 and opts.declare_data_parallel else {}
    role = "both" if decoders_prefill else "decode"
    backends = [{"name": f"d{i}", "url": url, "role": role, "models": [MODEL], **dp} for i, url in enumerate(decoders)]
    backends += [
        {"name": f"p{i}", "url": url, "role": "prefill", "models": [MODEL]} for i, url in enumerate(prefillers)
    ]
    if kv_events and reads_index(opts.strategy):
        for b in backends:
            if b["url"] in kv_events:
                b["kv_events_endpoint"], b["kv_events_replay_endpoint"] = kv_events[b["url"]]
    return "# generated by python -m bench\n" + tomli_w.dumps(
        {
            "server": {
                "host": "127.0.0.1",
                "port": port,
                "log_level": opts.log_level,
                "max_concurrent_requests": opts.max_concurrent_requests,
                "max_queued_requests": opts.max_queued_requests,
                **opts.extra_server,
            },
            "routing": routing,
            "timeouts": {"connect_s": 5.0, "first_token_s": 300.0, "idle_s": 120.0, "total_s": 900.0},
            "health": {"scrape_interval_s": SCRAPE_INTERVAL_S, "check_interval_s": 1.0},
            "backends": backends,
        }
    )


def peer_executable(name: str) -> str:
    """The path of a peer router's program (`vllm-router`, or `smg` of SGLang's router)."""
    exe = shutil.which(name, path=str(Path(PY).parent)) or shutil.which(name)
    if not exe:
        pkg = {"smg": "sglang-router", "vllm-router": "vllm-router"}[name]
        raise RuntimeError(f"{name} is not installed (pip install {pkg})")
    return exe


def peer_router_command(name: str, policy: str, port: int, prometheus_port: int, decoders: list[str]) -> list[str]:
    """A peer router in front of `decoders`: vllm-router, or SGLang's (`smg launch`)."""
    vllm = name == "vllm-router"
    cmd = [peer_executable(name)] if vllm else [peer_executable(name), "launch"]
    return [
        *cmd,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *decoders,
        "--policy",
        policy,
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        "warning" if vllm else "warn",
    ]


def router_command() -> list[str]:
    exe = shutil.which("router", path=str(Path(PY).parent)) or shutil.which("router")
    return [exe] if exe else [PY, "-m", "router.cli"]


@dataclass
class Cluster:
    """Running engines and (optionally) a router. `url` is where clients send requests."""

    procs: ProcessSet
    decoders: list[str]
    prefillers: list[str]
    url: str = ""
    router: Proc | None = None
    router_kind: str = ""  # ours | vllm-router | ""
    engine_procs: list[Proc] = field(default_factory=list)
    _owners: list[Proc] = field(default_factory=list)  # the process of each engine, in engines order
    replicas: list[Proc] = field(default_factory=list)  # router replicas (harness/replicas.py), the first is `router`
    # Engine URL -> (KV-event endpoint, replay endpoint) of the engines started.
    kv_events: dict[str, tuple[str, str]] = field(default_factory=dict)
    data_parallel_size: int = 1  # of the decode servers (SimOptions.data_parallel_size)
    decoders_prefill: bool = False  # the decoders are NIXL producers too (kv_both), set before start_engines

    @property
    def engines(self) -> list[str]:
        return self.decoders + self.prefillers

    async def start_engines(
        self,
        k: int,
        p: int,
        sim: SimOptions,
        cores: list[int] | None = None,
        engines_per_process: int = 0,
        extra_decoder: tuple[str, ...] = (),
    ) -> None:
        self.data_parallel_size = sim.data_parallel_size
        decoder_role = "both" if self.decoders_prefill else "consumer"
        for role, n, out in ((decoder_role, k, self.decoders), ("producer", p, self.prefillers)):
            if n <= 0:
                continue
            ports = free_ports(n)
            step = engines_per_process or n
            # A decode server's DP ranks publish on its ports plus their rank (vLLM's offsets).
            dp = sim.data_parallel_size if (decoder := out is self.decoders) else 1
            dp_args = ("--data-parallel-size", str(dp)) if dp > 1 else ()
            for j in range(0, n, step):
                group = ports[j : j + step]
                # Every engine publishes its KV events (vLLM's --kv-events-config), whatever
                # the mode: the engines are the same for every mode of a run.
                ev, rp = free_port_run(len(group) * dp), free_port_run(len(group) * dp)
                events = {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{ev}",
                    "replay_endpoint": f"tcp://*:{rp}",
                }
                for i, pt in enumerate(group):
                    self.kv_events[f"http://127.0.0.1:{pt}"] = (
                        f"tcp://127.0.0.1:{ev + i * dp}",
                        f"tcp://127.0.0.1:{rp + i * dp}",
                    )
                cmd = [
                    PY,
                    "-m",
                    "engine_launcher.sim",
                    *(arg for pt in group for arg in ("--port", str(pt))),
                    "--role",
                    role,
                    "--kv-events-config",
                    json.dumps(events),
                    *sim.args(),
                    *(extra_decoder if decoder else ()),
                    *dp_args,
                ]
                proc = self.procs.start(f"sim-{'consumer' if decoder else role}-{j}", pinned(cmd, cores))
                for _ in group:
                    self._owners.append(proc)
                self.engine_procs.append(proc)
                out.extend(f"http://127.0.0.1:{pt}" for pt in group)
        await asyncio.gather(
            *(wait_http(u + "/health", p, 60) for u, p in zip(self.engines, self._owners, strict=False))
        )

    async def start_router(
        self, opts: RouterOptions, work_dir: Path, cores: list[int] | None = None, port: int | None = None
    ) -> None:
        port = port or free_ports(1)[0]
        work_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any traffic
        cfg = work_dir / "router.toml"
        dp, both = self.data_parallel_size, self.decoders_prefill
        cfg.write_text(router_toml(port, self.decoders, self.prefillers, opts, self.kv_events, dp, both))
        self.router = self.procs.start(
            "router", pinned([*router_command(), "--config", str(cfg), "--no-engines"], cores)
        )
        self.router_kind = "ours"
        self.url = f"http://127.0.0.1:{port}"
        await wait_http(self.url + "/ready", self.router, 60)

    async def start_vllm_router(self, policy: str, cores: list[int] | None = None) -> None:
        port, prom = free_ports(2)
        cmd = peer_router_command("vllm-router", policy, port, prom, self.decoders)
        self.router = self.procs.start(f"vllm-router-{policy}", pinned(cmd, cores))
        self.router_kind = "vllm-router"
        self.url = f"http://127.0.0.1:{port}"
        await wait_http(self.url + "/health", self.router, 90)

    def direct(self) -> None:
        """No router: clients talk to the first decode engine."""
        self.url = self.decoders[0]

    async def stop(self) -> None:
        self.procs.stop_all()


# --- metrics ----------------------------------------------------------------------------
async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, list[tuple[dict[str, Any], float]]]:
    """name -> [(labels, value)] from a Prometheus /metrics page."""
    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        text = await r.text()
    out: dict[str, list[tuple[dict[str, Any], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def metric_sum(m: dict[str, Any], name: str, **labels: str) -> float:
    return float(sum(v for lab, v in m.get(name, ()) if all(lab.get(k) == x for k, x in labels.items())))


ENGINE_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
)


async def engine_counters(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, dict[str, Any]]:
    """Per engine: its counters (floats) and its TTFT histogram buckets (`ttft_buckets`)."""
    pages = await asyncio.gather(*(scrape(session, u) for u in urls))
    out = {}
    for u, m in zip(urls, pages, strict=False):
        d: dict[str, Any] = {n: metric_sum(m, n) for n in ENGINE_COUNTERS}
        d["cpu_tier_hit_tokens"] = metric_sum(m, "vllm:prompt_tokens_cached_by_source_total", source="host")
        for reason in ("cache_threshold", "length", "stop", "abort"):
            d[f"finished_{reason}"] = metric_sum(m, "vllm:request_success_total", finished_reason=reason)
        d["ttft_buckets"] = histogram_buckets(m, "vllm:time_to_first_token_seconds")
        out[u] = d
    return out


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for u in after:
        b = before.get(u, {})
        out[u] = {
            k: (buckets_delta(b.get(k, []), v) if isinstance(v, list) else v - b.get(k, 0.0))
            for k, v in after[u].items()
        }
    return out


def sum_buckets(lists: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    acc: dict[float, float] = {}
    for bl in lists:
        for le, c in bl:
            acc[le] = acc.get(le, 0.0) + c
    return sorted(acc.items())


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style quantile from cumulative (le, count) pairs (sorted, +Inf last)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def histogram_buckets(m: dict[str, Any], name: str, **labels: str) -> list[tuple[float, float]]:
    """Cumulative buckets of histogram `name` (without _bucket), summed over other labels."""
    acc: dict[float, float] = {}
    for lab, v in m.get(name + "_bucket", ()):
        if all(lab.get(k) == x for k, x in labels.items()):
            le = float(lab["le"])
            acc[le] = acc.get(le, 0.0) + v
    return sorted(acc.items())


def buckets_delta(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> list[tuple[float, float]]:
    b = dict(before)
    return [(le, c - b.get(le, 0.0)) for le, c in after]
