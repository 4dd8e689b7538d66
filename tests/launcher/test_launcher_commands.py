"""Exact command lines and environments built by engine_launcher.commands."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from engine_launcher.commands import ASYNC_SCHEDULER_CLS, SYNC_SCHEDULER_CLS, EngineCommand, build_commands
from engine_launcher.host import HostInfo
from engine_launcher.placement import assign_cpu_cores
from engine_launcher.ports import EnginePorts, ports_to_pick, resolve_ports
from router.config.parse import load_config
from router.config.schema import ConfigError, EngineConfig
from router.names import EngineRole

PY = "/opt/py/bin/python"
CPU_HOST = HostInfo(gpu_count=0, cpu_ids=(0, 1))
GPU_HOST = HostInfo(gpu_count=4, cpu_ids=tuple(range(16)))
VLLM_HEAD = [PY, "-m", "vllm.entrypoints.openai.api_server"]


def vllm_engine(name: str, role: str, **kw: Any) -> EngineConfig:
    return EngineConfig(name=name, kind="vllm", role=EngineRole(role), model="/models/tiny", **kw)


def kv_config(role: str, device: str) -> str:
    return json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": device}, separators=(",", ":")
    )


def eports(http: int, nixl: int | None = None) -> EnginePorts:
    """An engine's ports; its KV-event ports follow from the HTTP port (clear of the others)."""
    return EnginePorts(http, nixl, 20000 + http, 30000 + http)


def events_config(port: int, replay: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": "",
        },
        separators=(",", ":"),
    )


def ipc_pair(log_dir: str, name: str) -> tuple[str, str]:
    """A loopback engine's (stream, replay) sockets: {log_dir}/kv-events, made absolute."""
    d = os.path.join(os.path.abspath(log_dir), "kv-events")
    return f"ipc://{d}/{name}.events", f"ipc://{d}/{name}.replay"


def ipc_config(log_dir: str, name: str) -> str:
    stream, replay = ipc_pair(log_dir, name)
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": stream,
            "replay_endpoint": replay,
            "topic": "",
        },
        separators=(",", ":"),
    )


def picked_for(engines: list[EngineConfig], base: int = 40000) -> dict[tuple[str, str], int]:
    """Distinct made-up picks for every port the engines leave at 0."""
    return {(name, which): base + i for i, (name, which, _) in enumerate(ports_to_pick(engines))}


def one(engine: EngineConfig, host: HostInfo, http: int = 9000, nixl: int = 5600) -> EngineCommand:
    (cmd,) = build_commands([engine], {engine.name: eports(http, nixl)}, host, log_dir="logs", python=PY)
    return cmd


@pytest.mark.parametrize(
    ("role", "kv_role"), [("producer", "kv_producer"), ("consumer", "kv_consumer"), ("both", "kv_both")]
)
def test_vllm_cpu_host_exact_argv_and_env(role: str, kv_role: str) -> None:
    cmd = one(vllm_engine("e0", role), CPU_HOST)
    assert list(cmd.argv) == [
        *VLLM_HEAD,
        "--model",
        "/models/tiny",
        "--served-model-name",
        "/models/tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        kv_config(kv_role, "cpu"),
        "--scheduler-cls",
        SYNC_SCHEDULER_CLS,
        "--kv-events-config",
        # A loopback engine: ipc sockets, whatever event ports it was given.
        ipc_config("logs", "e0"),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--enforce-eager",
    ]
    assert dict(cmd.env) == {
        "PYTHONUNBUFFERED": "1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
        # NIXL's progress thread sleeps in poll() instead of spinning a core (plugin).
        "CACHEHIT_NIXL_PROGRESS_DELAY_US": "10000",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # A lone engine gets every CPU of the host.
        "VLLM_CPU_OMP_THREADS_BIND": "0,1",
        "UCX_TLS": "tcp,self",
    }
    assert cmd.kind == "vllm"
    assert cmd.engines == ("e0",)
    assert cmd.log_file == "logs/e0.log"
    assert dict(cmd.urls) == {"e0": "http://127.0.0.1:9000"}
    assert dict(cmd.kv_events) == {"e0": ipc_pair("logs", "e0")}
    assert cmd.health_urls() == {"e0": "http://127.0.0.1:9000/health"}


@pytest.mark.parametrize(
    ("role", "kv_role"), [("producer", "kv_producer"), ("consumer", "kv_consumer"), ("both", "kv_both")]
)
def test_vllm_gpu_host_exact_argv_and_env(role: str, kv_role: str) -> None:
    e = vllm_engine(
        "g0", role, served_model_name="llama", gpu_ids=(2, 3), nixl_side_channel_host="10.0.0.5", host="0.0.0.0"
    )
    cmd = one(e, GPU_HOST, http=8200, nixl=5601)
    assert list(cmd.argv) == [
        *VLLM_HEAD,
        "--model",
        "/models/tiny",
        "--served-model-name",
        "llama",
        "--host",
        "0.0.0.0",
        "--port",
        "8200",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        kv_config(kv_role, "cuda"),
        "--scheduler-cls",
        ASYNC_SCHEDULER_CLS,
        "--kv-events-config",
        events_config(28200, 38200),
    ]
    assert dict(cmd.env) == {
        "PYTHONUNBUFFERED": "1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
        "CACHEHIT_NIXL_PROGRESS_DELAY_US": "10000",
        "CUDA_VISIBLE_DEVICES": "2,3",
    }
    # A wildcard listener is reached through loopback.
    assert dict(cmd.urls) == {"g0": "http://127.0.0.1:8200"}
    assert dict(cmd.kv_events) == {"g0": ("tcp://127.0.0.1:28200", "tcp://127.0.0.1:38200")}


@pytest.mark.parametrize(
    ("role", "kv_role"), [("producer", "kv_producer"), ("consumer", "kv_consumer"), ("both", "kv_both")]
)
def test_kv_offload_gib_adds_the_offloading_connector_beside_nixl(role: str, kv_role: str) -> None:
    cmd = one(vllm_engine("g0", role, kv_offload_gib=64.5), GPU_HOST)
    argv = list(cmd.argv)
    # Exactly this JSON: a MultiConnector, NIXL first, then the CPU tier in bytes (GiB * 2^30,
    # as vLLM converts --kv-offloading-size), which that flag itself would not keep NIXL for.
    assert argv[argv.index("--kv-transfer-config") + 1] == (
        '{"kv_connector":"MultiConnector","kv_role":"' + kv_role + '",'
        '"kv_connector_extra_config":{"connectors":['
        '{"kv_connector":"NixlConnector","kv_role":"' + kv_role + '","kv_buffer_device":"cuda"},'
        '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
        '"kv_connector_extra_config":{"cpu_bytes_to_use":69256347648}}]}}'
    )
    assert "--kv-offloading-size" not in argv
    # Without the key: NIXL alone, as before.
    plain = list(one(vllm_engine("g0", role), GPU_HOST).argv)
    assert plain[plain.index("--kv-transfer-config") + 1] == kv_config(kv_role, "cuda")


def test_kv_offload_gib_on_a_cpu_host_is_a_configuration_error() -> None:
    # vLLM 0.32's CPU build refuses the OffloadingConnector at start; say so before starting.
    e = vllm_engine("e0", "both", kv_offload_gib=1.0)
    with pytest.raises(ConfigError, match=r"engines\[0\]\.kv_offload_gib: .*needs a CUDA or XPU GPU"):
        one(e, CPU_HOST)


def test_kv_offload_gib_gives_sim_engines_a_cpu_tier_in_tokens() -> None:
    e = EngineConfig(name="s0", kind="sim", role=EngineRole.BOTH, kv_offload_gib=2.0)
    cmd = one(e, CPU_HOST)
    argv = list(cmd.argv)
    # 2 GiB of 128 KiB-per-token KV (the simulated Llama-3.1-8B) = 16,384 tokens.
    assert argv[argv.index("--cpu-offload-tokens") + 1] == "16384"
    # Sim engines with different tiers are different processes.
    engines = [e, EngineConfig(name="s1", kind="sim", role=EngineRole.BOTH)]
    cmds = build_commands(engines, {"s0": eports(9000), "s1": eports(9001)}, CPU_HOST, log_dir="logs", python=PY)
    assert [c.engines for c in cmds] == [("s0",), ("s1",)]


def test_kv_offload_gib_must_not_be_negative(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text('[[engines]]\nname = "a"\nkind = "sim"\nkv_offload_gib = -1\n')
    with pytest.raises(ConfigError, match=r"engines\[0\]\.kv_offload_gib: expected a non-negative"):
        load_config(path)


def test_gpu_host_without_async_scheduling_uses_sync_scheduler() -> None:
    cmd = one(vllm_engine("g0", "consumer", extra_args=("--no-async-scheduling",)), GPU_HOST)
    i = cmd.argv.index("--scheduler-cls")
    assert cmd.argv[i + 1] == SYNC_SCHEDULER_CLS
    assert cmd.argv[-1] == "--no-async-scheduling"


def test_extra_args_come_last_and_replace_launcher_defaults() -> None:
    extra = ("--dtype", "bfloat16", "--block-size=64", "--max-model-len", "1024", "--scheduler-cls", "my.Sched")
    cmd = one(vllm_engine("e0", "consumer", extra_args=extra), CPU_HOST)
    argv = list(cmd.argv)
    assert argv[-len(extra) :] == list(extra)
    # CPU defaults the user chose are not emitted twice; the rest stay.
    assert argv.count("--dtype") == 1
    assert "float32" not in argv
    assert "--block-size" not in argv
    assert "--enforce-eager" in argv
    # Flags the launcher always sets stay, and the user's later copy wins (argparse: last one).
    assert argv.index("--scheduler-cls") < len(argv) - len(extra)
    assert argv[argv.index("my.Sched") - 1] == "--scheduler-cls"


def test_user_env_overrides_launcher_env() -> None:
    e = vllm_engine(
        "e0", "producer", env=(("UCX_TLS", "rc,tcp"), ("VLLM_CPU_KVCACHE_SPACE", "4"), ("HF_HOME", "/cache"))
    )
    env = one(e, CPU_HOST).env
    assert env["UCX_TLS"] == "rc,tcp"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["HF_HOME"] == "/cache"


def test_cpu_engines_get_disjoint_cores() -> None:
    engines = [vllm_engine("a", "producer"), vllm_engine("b", "consumer"), vllm_engine("c", "consumer", cpu_cores=(7,))]
    host = HostInfo(gpu_count=0, cpu_ids=(0, 1, 2, 3, 4, 5, 6, 7))
    cores = assign_cpu_cores(engines, host)
    assert cores == {"c": (7,), "a": (0, 1, 2, 3), "b": (4, 5, 6)}
    # More engines than CPUs: single CPUs in turn.
    many = [vllm_engine(f"e{i}", "consumer") for i in range(3)]
    assert assign_cpu_cores(many, CPU_HOST) == {"e0": (0,), "e1": (1,), "e2": (0,)}


def test_two_cpu_engines_bind_one_core_each_in_their_commands() -> None:
    engines = [vllm_engine("p", "producer"), vllm_engine("c", "consumer")]
    ports = {"p": eports(9001, 5601), "c": eports(9002, 5602)}
    p, c = build_commands(engines, ports, CPU_HOST, log_dir="l", python=PY)
    assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert c.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_gpus_spread_one_per_engine_and_too_few_gpus_is_a_config_error() -> None:
    engines = [vllm_engine(f"e{i}", "consumer") for i in range(2)] + [vllm_engine("x", "producer", gpu_ids=(0,))]
    ports = {e.name: eports(9000 + i, 5600 + i) for i, e in enumerate(engines)}
    cmds = build_commands(engines, ports, HostInfo(gpu_count=3), log_dir="l", python=PY)
    assert [c.env.get("CUDA_VISIBLE_DEVICES") for c in cmds] == ["1", "2", "0"]
    with pytest.raises(ConfigError, match=r"engines\[1\]\.gpu_ids"):
        build_commands(engines, ports, HostInfo(gpu_count=2), log_dir="l", python=PY)
    # One engine without gpu_ids sees every GPU (tensor parallelism through extra_args).
    assert "CUDA_VISIBLE_DEVICES" not in one(vllm_engine("solo", "both"), GPU_HOST).env


def test_identical_sim_engines_share_one_process() -> None:
    cfg = load_config("router.toml")
    # Loopback engines: no event port to pick.
    assert ports_to_pick(cfg.engines) == []
    ports = resolve_ports(cfg.engines)
    cmds = build_commands(cfg.engines, ports, CPU_HOST, log_dir="engine-logs", python=PY)
    assert [c.engines for c in cmds] == [("decode-0", "decode-1", "decode-2", "decode-3"), ("prefill-0",)]
    decode, prefill = cmds
    assert list(decode.argv) == [
        PY,
        "-m",
        "engine_launcher.sim",
        "--port",
        "8101",
        "--port",
        "8102",
        "--port",
        "8103",
        "--port",
        "8104",
        "--host",
        "127.0.0.1",
        "--role",
        "consumer",
        "--model",
        "sim-llama-8b",
        # One stream per engine, in --port order: loopback engines, ipc sockets of their own.
        "--kv-events-config",
        ipc_config("engine-logs", "decode-0"),
        "--kv-events-config",
        ipc_config("engine-logs", "decode-1"),
        "--kv-events-config",
        ipc_config("engine-logs", "decode-2"),
        "--kv-events-config",
        ipc_config("engine-logs", "decode-3"),
    ]
    assert list(prefill.argv) == [
        PY,
        "-m",
        "engine_launcher.sim",
        "--port",
        "8105",
        "--host",
        "127.0.0.1",
        "--role",
        "producer",
        "--model",
        "sim-llama-8b",
        "--kv-events-config",
        ipc_config("engine-logs", "prefill-0"),
    ]
    assert dict(decode.env) == {"PYTHONUNBUFFERED": "1"}
    assert decode.name == "decode-0"
    assert decode.log_file == "engine-logs/decode-0.log"
    assert dict(decode.urls) == {f"decode-{i}": f"http://127.0.0.1:{8101 + i}" for i in range(4)}
    assert dict(decode.kv_events) == {f"decode-{i}": ipc_pair("engine-logs", f"decode-{i}") for i in range(4)}


def test_sim_engines_with_different_options_do_not_share() -> None:
    engines = [
        EngineConfig(name="a", kind="sim", role=EngineRole.BOTH, port=1, model="m"),
        EngineConfig(name="b", kind="sim", role=EngineRole.BOTH, port=2, model="m", extra_args=("--speedup", "2")),
        EngineConfig(name="c", kind="sim", role=EngineRole.BOTH, port=3, model="m"),
        EngineConfig(name="d", kind="sim", role=EngineRole.BOTH, port=4, model="m", env=(("X", "1"),)),
        EngineConfig(
            name="e", kind="sim", role=EngineRole.BOTH, port=5, model="m", cpu_cores=(1,), served_model_name="served"
        ),
    ]
    engines.append(EngineConfig(name="f", kind="sim", role=EngineRole.BOTH, port=6, model="m", kv_events=False))
    cmds = build_commands(engines, resolve_ports(engines, picked_for(engines)), CPU_HOST, log_dir="l", python=PY)
    # An engine without events cannot share a process with engines that publish.
    assert [c.engines for c in cmds] == [("a", "c"), ("b",), ("d",), ("e",), ("f",)]
    assert cmds[1].argv[-2:] == ("--speedup", "2")
    assert cmds[2].env["X"] == "1"
    assert cmds[3].cpu_affinity == (1,)
    # The simulator serves one name: served_model_name when given.
    argv = list(cmds[3].argv)
    assert argv[argv.index("--model") + 1] == "served"
    assert "--kv-events-config" not in cmds[4].argv


def test_default_python_is_the_running_interpreter() -> None:
    cmd = build_commands([vllm_engine("e", "both")], {"e": eports(1, 2)}, CPU_HOST, log_dir="l")[0]
    assert cmd.argv[0] == sys.executable


def test_shell_line_quotes_json_and_puts_env_first() -> None:
    line = one(vllm_engine("e0", "producer"), CPU_HOST).shell_line()
    assert line.startswith("CACHEHIT_NIXL_PROGRESS_DELAY_US=10000 PYTHONUNBUFFERED=1 UCX_TLS=tcp,self ")
    assert '\'{"kv_connector":"NixlConnector"' in line


def test_gpus_stay_inside_the_launchers_own_visible_devices() -> None:
    from engine_launcher.host import visible_gpus

    engines = [vllm_engine("a", "producer"), vllm_engine("b", "consumer")]
    ports = {"a": eports(1, 2), "b": eports(3, 4)}
    host = HostInfo(gpu_count=2, cpu_ids=(0,), gpu_ids=(5, 7))
    cmds = build_commands(engines, ports, host, log_dir="l", python=PY)
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in cmds] == ["5", "7"]
    # The launcher's own CUDA_VISIBLE_DEVICES becomes the usable set.
    assert visible_gpus(8, None) == (8, ())
    assert visible_gpus(8, "3,1") == (2, (3, 1))
    assert visible_gpus(8, "2,-1,4") == (1, (2,))
    assert visible_gpus(8, "") == (0, ())
    assert visible_gpus(8, "GPU-aa,GPU-bb") == (2, ())
    assert visible_gpus(0, "0,1") == (0, ())
