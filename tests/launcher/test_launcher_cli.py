"""engine-launcher CLI: dry runs, configuration errors, forwarding, and a real run."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from engine_launcher.cli import main
from support.launcher_process import LauncherProcess
from support.ports import free_port
from support.processes import children_of, group_gone, pid_gone

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 120


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "router.toml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def events_flag(name: str) -> str:
    """The --kv-events-config of a loopback engine: ipc sockets in {log_dir}/kv-events."""
    stream, replay = ipc_pair(name)
    return (
        '--kv-events-config \'{"enable_kv_cache_events":true,"publisher":"zmq",'
        f'"endpoint":"{stream}","replay_endpoint":"{replay}","topic":""}}\''
    )


def ipc_pair(name: str) -> tuple[str, str]:
    d = os.path.join(os.path.abspath("engine-logs"), "kv-events")
    return f"ipc://{d}/{name}.events", f"ipc://{d}/{name}.replay"


def test_dry_run_prints_exact_commands_for_router_toml(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--config", str(REPO / "router.toml"), "--dry-run", "--host-type", "cpu"])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    py = sys.executable
    decodes = [f"decode-{i}" for i in range(4)]
    assert out == [
        "# engine-launcher --dry-run: 2 process(es) for 5 engine(s) on a CPU host "
        f"({len(os.sched_getaffinity(0))} CPUs)",
        # Loopback engines publish on ipc sockets: no port to pick.
        "",
        "# decode-0 (sim): decode-0 at http://127.0.0.1:8101, decode-1 at http://127.0.0.1:8102, "
        "decode-2 at http://127.0.0.1:8103, decode-3 at http://127.0.0.1:8104",
        *(f"# kv events of {n}: {ipc_pair(n)[0]}, replay {ipc_pair(n)[1]}" for n in decodes),
        "# log: engine-logs/decode-0.log",
        f"PYTHONUNBUFFERED=1 {py} -m engine_launcher.sim --port 8101 --port 8102 --port 8103 "
        "--port 8104 --host 127.0.0.1 --role consumer --model sim-llama-8b "
        + " ".join(events_flag(n) for n in decodes),
        "",
        "# prefill-0 (sim): prefill-0 at http://127.0.0.1:8105",
        f"# kv events of prefill-0: {ipc_pair('prefill-0')[0]}, replay {ipc_pair('prefill-0')[1]}",
        "# log: engine-logs/prefill-0.log",
        f"PYTHONUNBUFFERED=1 {py} -m engine_launcher.sim --port 8105 --host 127.0.0.1 "
        f"--role producer --model sim-llama-8b {events_flag('prefill-0')}",
    ]
    # A dry run makes no socket directory.
    assert not os.path.exists(os.path.dirname(ipc_pair("prefill-0")[0].removeprefix("ipc://")))


def test_up_subcommand_and_gpu_flavour(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(
        tmp_path,
        """
        [[engines]]
        name = "prefill"
        kind = "vllm"
        role = "producer"
        model = "/models/llama"
        port = 8200
        nixl_side_channel_port = 5600
        gpu_ids = [0]

        [[engines]]
        name = "decode"
        kind = "vllm"
        role = "consumer"
        model = "/models/llama"
        port = 8201
        nixl_side_channel_port = 5601
        gpu_ids = [1]
        host = "10.0.0.7"
        kv_events_port = 5701
        kv_events_replay_port = 5702
        extra_args = ["--max-model-len", "8192"]
        """,
    )
    assert main(["up", "--config", cfg, "--dry-run", "--host-type", "gpu", "--log-dir", "/var/log/engines"]) == 0
    out = capsys.readouterr().out
    kv = json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cuda"}, separators=(",", ":")
    )
    assert (
        f"CACHEHIT_NIXL_PROGRESS_DELAY_US=10000 CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1 "
        f"VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=5601 {sys.executable} -m "
        "vllm.entrypoints.openai.api_server --model /models/llama --served-model-name "
        "/models/llama --host 10.0.0.7 --port 8201 --enable-prefix-caching --enable-prompt-tokens-details "
        f"--kv-transfer-config '{kv}' --scheduler-cls "
        "engine_launcher.vllm_plugin.scheduler.ThresholdAsyncScheduler --kv-events-config "
        '\'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5701",'
        '"replay_endpoint":"tcp://*:5702","topic":""}\' --max-model-len 8192'
    ) in out.splitlines()
    # A non-loopback host keeps tcp (bound on every interface, reached at the host).
    assert "# kv events of decode: tcp://10.0.0.7:5701, replay tcp://10.0.0.7:5702" in out
    assert "# log: /var/log/engines/prefill.log" in out
    assert "on a GPU host" in out


def test_dry_run_shows_the_cpu_tier_connector(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(
        tmp_path,
        """
        [[engines]]
        name = "decode"
        kind = "vllm"
        role = "consumer"
        model = "/models/llama"
        port = 8201
        nixl_side_channel_port = 5601
        kv_offload_gib = 200
        """,
    )
    assert main(["--config", cfg, "--dry-run", "--host-type", "gpu"]) == 0
    out = capsys.readouterr().out
    kv = json.dumps(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {
                "connectors": [
                    {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cuda"},
                    {
                        "kv_connector": "OffloadingConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": 200 * 2**30},
                    },
                ]
            },
        },
        separators=(",", ":"),
    )
    assert f"--kv-transfer-config '{kv}'" in out


def test_dry_run_mentions_picked_ports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(
        tmp_path,
        """
        [[engines]]
        name = "sim-0"
        kind = "sim"
        """,
    )
    assert main(["--config", cfg, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# free ports were picked now for sim-0; a real start picks again" in out
    assert "--port 0" not in out


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('[[engines]]\nname = "e"\nkind = "bogus"\n', "engines[0].kind"),
        ('[[engines]]\nname = "e"\nkind = "vllm"\n', "engines[0].model"),
        ('[[engines]]\nname = "e"\nkind = "sim"\nport = 70000\n', "engines[0].port"),
        ('[[engines]]\nname = "e"\nkind = "sim"\ncolour = "red"\n', "engines[0].colour"),
        ('[launcher]\nmax_restarts = -1\n[[engines]]\nname = "e"\nkind = "sim"\n', "launcher.max_restarts"),
        (
            '[[engines]]\nname = "a"\nkind = "sim"\nport = 9000\n[[engines]]\nname = "b"\nkind = "sim"\nport = 9000\n',
            "engines[1].port",
        ),
        ('[[backends]]\nname = "b"\nurl = "http://h:1"\n', "engines"),
    ],
)
def test_bad_config_exits_2_and_names_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, key: str
) -> None:
    cfg = write(tmp_path, body)
    assert main(["--config", cfg, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"engine-launcher: configuration error: {key}")


def test_missing_config_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(tmp_path / "nope.toml")]) == 2
    assert "cannot read configuration file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("sub", "usage"),
    [
        ("sim", "usage: python -m engine_launcher.sim"),
        ("install-deps", "usage: engine-launcher install-deps"),
    ],
)
def test_sim_and_install_deps_subcommands_are_forwarded(
    capsys: pytest.CaptureFixture[str], sub: str, usage: str
) -> None:
    # Their own parsers answer --help: the launcher passed the rest of argv through.
    with pytest.raises(SystemExit) as exit_:
        main([sub, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


def test_tiny_model_subcommand_is_forwarded(capsys: pytest.CaptureFixture[str]) -> None:
    # tiny_model.main's own usage check answers: the launcher forwarded argv unchanged.
    assert main(["tiny-model", "--bad"]) == 2
    assert "usage: python -m engine_launcher.tiny_model DIR" in capsys.readouterr().err


def test_launcher_runs_sim_engines_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    cfg = write(
        tmp_path,
        f"""
        [launcher]
        log_dir = "{tmp_path / "logs"}"
        startup_timeout_s = 60

        [[engines]]
        name = "d0"
        kind = "sim"
        role = "consumer"
        port = {ports[0]}
        model = "sim-m"

        [[engines]]
        name = "d1"
        kind = "sim"
        role = "consumer"
        port = {ports[1]}
        model = "sim-m"

        [[engines]]
        name = "p0"
        kind = "sim"
        role = "producer"
        port = {ports[2]}
        model = "sim-m"
        """,
    )
    env = {**os.environ, "COLUMNS": "200"}
    lp = LauncherProcess([sys.executable, "-m", "engine_launcher", "--config", cfg], env=env, cwd=str(tmp_path))
    try:
        lp.wait_for_line("all engines healthy", HANG_GUARD_S)
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                assert r.status == 200
        engines = lp.record_engine_groups()
        assert len(engines) == 2  # d0+d1 share one simulator process, p0 has its own
        table = "\n".join(lp.lines)
        for name in ("d0", "d1", "p0"):
            assert name in table
        assert f"http://127.0.0.1:{ports[2]}" in table
        lp.proc.send_signal(signal.SIGTERM)
        out = lp.output(HANG_GUARD_S)
        assert lp.proc.returncode == 0, out
        assert "stopped" in out.splitlines()[-1]
        # Every engine process and its whole group is gone.
        assert all(pid_gone(p) and group_gone(p) for p in engines)
        assert children_of(lp.proc.pid) == []
    finally:
        lp.kill()


def test_launcher_exits_1_with_log_tail_when_an_engine_cannot_start(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        f"""
        [launcher]
        log_dir = "{tmp_path / "logs"}"

        [[engines]]
        name = "broken"
        kind = "sim"
        extra_args = ["--no-such-simulator-flag"]
        """,
    )
    lp = LauncherProcess(
        [sys.executable, "-m", "engine_launcher", "--config", cfg],
        env={**os.environ, "COLUMNS": "200"},
        cwd=str(tmp_path),
    )
    try:
        out = lp.output(HANG_GUARD_S)
        assert lp.proc.returncode == 1, out
        assert "engine 'broken' exited with code 2 before it was healthy" in out
        assert "--no-such-simulator-flag" in out  # argparse's complaint, from the log tail
    finally:
        lp.kill()
