"""`python -m engine_launcher.sim --port 8001 [--port 8002 ...] [options]`.

Every flag maps to one `SimEngineConfig` field (docs/SIMULATOR.md). Repeating `--port`
starts several engines in this process, each with its own engine state, metrics registry
and faults, all with the same options.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from .config import (
    KV_LOAD_FAILURE_POLICIES,
    ROLES,
    FaultConfig,
    SimEngineConfig,
    TimingModel,
)
from .kv_events import KVEventsConfig, parse_kv_events_config
from .server import SimServer

log = logging.getLogger("engine_launcher.sim")


def build_parser() -> argparse.ArgumentParser:
    d = SimEngineConfig()
    t = TimingModel()
    p = argparse.ArgumentParser(
        prog="python -m engine_launcher.sim",
        description="vLLM 0.32-compatible engine simulator (OpenAI API, prefix cache, "
        "continuous batching, cache-hit threshold, NIXL-like prefill/decode).",
    )
    a = p.add_argument
    a(
        "--port",
        type=int,
        action="append",
        required=True,
        help="port of one engine; repeat for several engines in this process (0: free port)",
    )
    a("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    a("--model", "--served-model-name", dest="model", default=d.model, help="served model name (default %(default)s)")
    a("--role", choices=ROLES, default=d.role, help="NIXL role (default %(default)s)")
    a("--max-model-len", type=int, default=d.max_model_len)
    a(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served from the start (vLLM's --lora-modules; names only here)",
    )
    a("--lora-load-s", type=float, default=d.lora_load_s, help="seconds a runtime adapter load takes (at speed 1)")
    a(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=d.data_parallel_size,
        help="engine cores (KV caches) behind each port, chosen by X-data-parallel-rank (vLLM's DP)",
    )
    a("--block-size", type=int, default=d.block_size)
    a(
        "--num-gpu-blocks",
        "--num-gpu-blocks-override",
        dest="num_gpu_blocks",
        type=int,
        default=d.num_gpu_blocks,
        help="KV cache capacity in blocks (block 0 is reserved)",
    )
    a(
        "--cpu-offload-tokens",
        type=int,
        default=d.cpu_offload_tokens,
        help="CPU tier of the KV cache (vLLM's OffloadingConnector), in tokens (0: none)",
    )
    a(
        "--kv-bytes-per-token",
        type=int,
        default=d.kv_bytes_per_token,
        help="KV bytes per token of the simulated model (offload byte counters)",
    )
    a("--max-num-seqs", type=int, default=d.max_num_seqs)
    a("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    a("--speed", type=float, default=d.speed, help="time compression factor: 100 runs the timing model 100x faster")
    a("--step-overhead-s", type=float, default=t.step_overhead_s)
    a("--prefill-token-s", type=float, default=t.prefill_token_s)
    a("--decode-seq-s", type=float, default=t.decode_seq_s)
    a("--kv-transfer-token-s", type=float, default=t.kv_transfer_token_s)
    a("--cpu-load-token-s", type=float, default=t.cpu_load_token_s, help="seconds per token loaded from the CPU tier")
    a("--seed", type=int, default=d.seed)
    a("--eos-probability", type=float, default=d.eos_probability)
    a("--global-cache-hit-threshold", type=float, default=d.global_cache_hit_threshold)
    a(
        "--arrival-check",
        action=argparse.BooleanOptionalAction,
        default=d.arrival_check,
        help="also check the cache-hit threshold when a request arrives (default on)",
    )
    a(
        "--threshold-plugin",
        action=argparse.BooleanOptionalAction,
        default=d.threshold_plugin,
        help="honour cache_hit_threshold as the plugin does (default on); --no-threshold-plugin "
        "acts as a stock vLLM that ignores it",
    )
    a(
        "--kv-lease-duration",
        type=float,
        default=d.kv_lease_duration,
        help="seconds a producer keeps prefilled blocks for a consumer (real seconds)",
    )
    a(
        "--kv-load-failure-policy",
        choices=KV_LOAD_FAILURE_POLICIES,
        default=d.kv_load_failure_policy,
        help="a failed KV pull ends the request with an error (vLLM's default) or recomputes "
        "the prompt (default %(default)s)",
    )
    a(
        "--advertise-host",
        default=d.advertise_host,
        help="remote_host written in a producer's kv_transfer_params (default: --host)",
    )
    a("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=d.enable_prompt_tokens_details)
    a("--max-logprobs", type=int, default=d.max_logprobs)
    a("--fault-error-rate", type=float, default=0.0, help="fraction of requests answered with HTTP 500")
    a(
        "--fault-exit-after-tokens",
        type=int,
        default=0,
        help="exit the process after this many generated tokens (0: never)",
    )
    a("--fault-stall-after-tokens", type=int, default=0, help="stall each stream after this many tokens (0: never)")
    a("--fault-stall-seconds", type=float, default=0.0)
    a(
        "--kv-events-config",
        action="append",
        help="vLLM's KV cache event stream, as a JSON object of KVEventsConfig keys, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\' (default: off). '
        "Once: every engine of the process, ports offset by its index (an ipc:// path "
        "gets a _dp<index> suffix); once per --port: "
        "each engine its own, as given",
    )
    a("--enable-admin", action="store_true", help="enable POST /_sim/faults")
    a("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace) -> SimEngineConfig:
    cfg = SimEngineConfig(
        model=args.model,
        role=args.role,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        cpu_offload_tokens=args.cpu_offload_tokens,
        kv_bytes_per_token=args.kv_bytes_per_token,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        speed=args.speed,
        timing=TimingModel(
            step_overhead_s=args.step_overhead_s,
            prefill_token_s=args.prefill_token_s,
            decode_seq_s=args.decode_seq_s,
            kv_transfer_token_s=args.kv_transfer_token_s,
            cpu_load_token_s=args.cpu_load_token_s,
        ),
        seed=args.seed,
        eos_probability=args.eos_probability,
        global_cache_hit_threshold=args.global_cache_hit_threshold,
        arrival_check=args.arrival_check,
        kv_lease_duration=args.kv_lease_duration,
        threshold_plugin=args.threshold_plugin,
        kv_load_failure_policy=args.kv_load_failure_policy,
        advertise_host=args.advertise_host,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        max_logprobs=args.max_logprobs,
        faults=FaultConfig(
            error_rate=args.fault_error_rate,
            exit_after_tokens=args.fault_exit_after_tokens,
            stall_after_tokens=args.fault_stall_after_tokens,
            stall_seconds=args.fault_stall_seconds,
        ),
        enable_admin=args.enable_admin,
        kv_events_config=parse_kv_events_config(args.kv_events_config[0]) if args.kv_events_config else None,
        data_parallel_size=args.data_parallel_size,
        lora_modules=dict(m.split("=", 1) if "=" in m else (m, m) for m in args.lora_modules),
        lora_load_s=args.lora_load_s,
    )
    cfg.validate()
    return cfg


def kv_events_configs(args: argparse.Namespace) -> list[KVEventsConfig | None]:
    """Each engine's event stream: one config for all, offset per engine as vLLM offsets
    DP ranks, or one per --port (a launcher picking unrelated free ports gives these)."""
    texts: list[str] = args.kv_events_config or []
    count = len(args.port)
    if not texts:
        return [None] * count
    configs = [parse_kv_events_config(t) for t in texts]
    if len(configs) == 1:
        # Each port's ranks take the next data_parallel_size offsets.
        return [configs[0].for_rank(i * args.data_parallel_size) for i in range(count)]
    if len(configs) != count:
        raise ValueError(
            f"--kv-events-config: given {len(configs)} times for {count} --port(s); "
            "give it once (ports offset per engine) or once per --port"
        )
    return list(configs)


async def serve(configs: list[SimEngineConfig], host: str, ports: list[int]) -> None:
    servers = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        for cfg, port in zip(configs, ports, strict=True):
            server = SimServer(cfg, exit_process_on_fault=True)
            actual = await server.start(host, port)
            servers.append(server)
            # One line per engine, flushed: launchers and tests read the port from it.
            print(f"sim engine listening on http://{host}:{actual} model={cfg.model} role={cfg.role}", flush=True)
        await stop.wait()
    finally:
        for s in servers:
            await s.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        base = config_from_args(args)
        events = kv_events_configs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configs = [copy.deepcopy(base) for _ in args.port]
    for cfg, kv in zip(configs, events, strict=True):
        cfg.kv_events_config = kv
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is optional (not on Windows)
        runner = asyncio.run
    try:
        runner(serve(configs, args.host, args.port))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
