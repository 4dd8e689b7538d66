"""Which CPU cores or GPUs each vllm engine gets on the host (pure functions).

CPU hosts: cores for vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND); GPU hosts: the
devices of CUDA_VISIBLE_DEVICES. Errors name the config key (`engines[i].gpu_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.config.schema import ConfigError, EngineConfig

from .host import HostInfo


def engine_key(engines: Sequence[EngineConfig], name: str) -> str:
    """The config key of the engine called `name` (`engines[i]`), for error messages."""
    for i, e in enumerate(engines):
        if e.name == name:
            return f"engines[{i}]"
    return "engines"


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
            f"{engine_key(engines, e.name)}.gpu_ids: {len(rest)} vllm engines without gpu_ids "
            f"but only {len(free)} unclaimed GPU(s) on this host; set gpu_ids for each engine "
            f"(and --gpu-memory-utilization in extra_args to share a GPU)"
        )
    # free has at least len(rest) entries (checked above); the extra ones stay unused.
    for e, g in zip(rest, free[: len(rest)], strict=True):
        out[e.name] = (g,)
    return out


__all__ = ["assign_cpu_cores", "assign_gpus", "engine_key"]
