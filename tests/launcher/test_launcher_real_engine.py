"""One real vLLM engine (CPU build) started by `engine-launcher --config`, on the tiny model.

Skipped when vLLM is not installed, unless support.requirements.real_engine_required()
(CI): then a missing vLLM fails. An installed vLLM that does not
start always fails, with the engine's log tail in the message.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from support.launcher_process import LauncherProcess
from support.ports import free_port
from support.processes import children_of, group_gone, pid_gone
from support.requirements import missing_dependency

# Engine start-up may take minutes on a loaded 2-core machine (START_GUARD_S below).
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

# Hang guards: a start takes 15-40 s on 2 idle cores, much longer on a busy shared machine.
START_GUARD_S = 600
STOP_GUARD_S = 120


def require_vllm() -> None:
    missing = [m for m in ("vllm", "nixl") if importlib.util.find_spec(m) is None]
    if not missing:
        return
    missing_dependency(f"{', '.join(missing)} not installed; run `engine-launcher install-deps --cpu`")


@pytest.fixture(scope="session")
def tiny_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    # Built once and cached across runs (the builder skips a finished build); in a
    # subprocess so this test process does not import torch and transformers. With pytest's
    # cache plugin off (-p no:cacheprovider) it is built in this run's temp dir instead.
    cache = getattr(request.config, "cache", None)
    path = cache.mkdir("cachehit-tiny-model") if cache is not None else tmp_path_factory.mktemp("cachehit-tiny-model")
    subprocess.run(
        [sys.executable, "-m", "engine_launcher.tiny_model", str(path)], check=True, stdout=subprocess.DEVNULL
    )
    return str(path)


def test_launcher_starts_real_vllm_answers_a_completion_and_stops_clean(tmp_path: Path, tiny_model_dir: str) -> None:
    require_vllm()
    port = free_port()
    cfg = tmp_path / "router.toml"
    cfg.write_text(
        textwrap.dedent(f"""
        [launcher]
        log_dir = "{tmp_path / "logs"}"
        startup_timeout_s = {START_GUARD_S - 60}

        [[engines]]
        name = "tiny-0"
        kind = "vllm"
        role = "both"
        model = "{tiny_model_dir}"
        served_model_name = "tiny"
        port = {port}
        extra_args = ["--max-model-len", "1024", "--max-num-seqs", "4"]
        """)
    )
    lp = LauncherProcess(
        [sys.executable, "-m", "engine_launcher", "--config", str(cfg)],
        env={**os.environ, "COLUMNS": "200"},
        cwd=str(tmp_path),
    )
    try:
        lp.wait_for_line("all engines healthy", START_GUARD_S)
        (engine_pid,) = lp.record_engine_groups()
        body = json.dumps(
            {
                "model": "tiny",
                "prompt": "the cache block token prefix",
                "max_tokens": 4,
                "ignore_eos": True,
                "temperature": 0,
            }
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            answer = json.loads(r.read())
        assert answer["model"] == "tiny"
        assert answer["usage"]["completion_tokens"] == 4
        assert answer["choices"][0]["finish_reason"] == "length"
        log = (tmp_path / "logs" / "tiny-0.log").read_text()
        # vLLM resolved the plugin's scheduler and built the NIXL connector for role both.
        assert ("Using custom scheduler class engine_launcher.vllm_plugin.scheduler.ThresholdScheduler") in log
        assert "Using kv_role='kv_both' with NixlConnector" in log

        lp.proc.send_signal(signal.SIGTERM)
        out = lp.output(STOP_GUARD_S)
        assert lp.proc.returncode == 0, out
        # The API server, its engine core and workers: the whole group is gone.
        assert pid_gone(engine_pid)
        assert group_gone(engine_pid)
        assert children_of(lp.proc.pid) == []
    finally:
        lp.kill()
