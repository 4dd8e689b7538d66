"""Fixtures for tests against real vLLM 0.32 engines (CPU build) with the threshold plugin.

- `tiny_model`: the random-weight Llama of engine_launcher.tiny_model, built once per session
  in a temp dir (seconds).
- `real_engines`: the two engines this suite needs, started together (one CPU core each) the
  first time a test asks for either, from the launcher's own command line
  (engine_launcher.commands.vllm_command), and killed as whole process groups at the end:
    "threshold":  plugin, --additional-config global_cache_hit_threshold 0.5 (arrival check
                  on, the default), --max-num-seqs 2; it is also a NIXL kv_both engine, so it
                  serves prefill legs (do_remote_decode).
    "preemption": plugin, --num-gpu-blocks-override 8 (vLLM keeps one as the null block,
                  so 7 x 32 = 224 tokens: --max-model-len 224), --max-num-seqs 2,
                  arrival check off.
  Starting both together costs one start-up (~30-150 s on this machine) instead of two.
- CACHEHIT_REQUIRE_REAL_ENGINE=1 (CI): an engine that cannot start fails the tests;
  otherwise they are skipped with the reason.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from real_engine_util import (  # noqa: E402
    EngineProcess, EngineStartError, engine_command, free_port, real_engine_required,
    vllm_missing_reason,
)

STARTUP_TIMEOUT_S = float(os.environ.get("CACHEHIT_ENGINE_STARTUP_TIMEOUT", "420"))

# Eager sampler kernels: the first logprobs request would otherwise compile one with
# inductor + g++ (minutes on two busy cores); see docs/VLLM_WIRE.md.
ENGINE_ENV = {"TORCHDYNAMO_DISABLE": "1"}

ENGINE_SPECS = {
    "threshold": dict(
        cpu_cores=(0,),
        extra_args=(
            "--max-model-len", "2048", "--max-num-seqs", "2",
            "--additional-config", json.dumps({"global_cache_hit_threshold": 0.5}),
        ),
    ),
    "preemption": dict(
        cpu_cores=(1,),
        extra_args=(
            "--max-model-len", "224", "--max-num-seqs", "2",
            "--num-gpu-blocks-override", "8",
            "--additional-config", json.dumps({"cache_hit_arrival_check": False}),
        ),
    ),
}


def _unavailable(reason: str):
    if real_engine_required():
        pytest.fail(f"CACHEHIT_REQUIRE_REAL_ENGINE is set but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def engine_workdir():
    with tempfile.TemporaryDirectory(prefix="cachehit-real-engine-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def tiny_model(engine_workdir):
    reason = vllm_missing_reason()
    if reason:
        _unavailable(reason)
    from engine_launcher.tiny_model import build_tiny_model

    return build_tiny_model(engine_workdir / "tiny-model")


class EngineSet:
    """Starts every spec at once on first use; remembers a start-up failure for all tests."""

    def __init__(self, model_dir: Path, workdir: Path) -> None:
        self.model_dir = model_dir
        self.workdir = workdir
        self.engines: dict[str, EngineProcess] = {}
        self.error: str | None = None
        self.started = False

    def _spawn(self, name: str, attempt: int) -> EngineProcess:
        spec = ENGINE_SPECS[name]
        port = free_port()
        argv, env = engine_command(
            self.model_dir, name=name, port=port, nixl_port=free_port(),
            role="both", cpu_cores=spec["cpu_cores"], extra_args=spec["extra_args"],
            env=ENGINE_ENV, log_dir=self.workdir)
        log = self.workdir / (f"{name}.log" if attempt == 0 else f"{name}.retry{attempt}.log")
        return EngineProcess(argv, env, port, log).start()

    def start_all(self) -> None:
        self.started = True
        try:
            for name in ENGINE_SPECS:
                self.engines[name] = self._spawn(name, 0)
            for name in ENGINE_SPECS:
                try:
                    took = self.engines[name].wait_healthy(STARTUP_TIMEOUT_S)
                except EngineStartError as exc:
                    # A port picked free can still be taken before vLLM binds it (NIXL's
                    # side channel, vLLM's ZMQ sockets): retry that case once, nothing else.
                    if "Address already in use" not in str(exc):
                        raise
                    self.engines[name].stop()
                    self.engines[name] = self._spawn(name, 1)
                    took = self.engines[name].wait_healthy(STARTUP_TIMEOUT_S)
                engine = self.engines[name]
                print(f"\n[real engine] {name}: healthy after {took:.1f} s "
                      f"({engine.base_url}, log {engine.log_path})")
        except (EngineStartError, OSError) as exc:
            self.error = f"a real vLLM engine did not start: {exc}"
            self.stop_all()

    def get(self, name: str) -> EngineProcess:
        if not self.started:
            self.start_all()
        if self.error:
            _unavailable(self.error)
        engine = self.engines[name]
        if engine.proc is None or engine.proc.poll() is not None:
            pytest.fail(f"engine {name} died (code {engine.proc.returncode if engine.proc else None}):"
                        f"\n{engine.log_tail()}", pytrace=False)
        return engine

    def stop_all(self) -> None:
        for engine in self.engines.values():
            engine.stop()


@pytest.fixture(scope="session")
def real_engines(tiny_model, engine_workdir):
    engines = EngineSet(tiny_model, engine_workdir)
    try:
        yield engines
    finally:
        engines.stop_all()


@pytest.fixture
def threshold_engine(real_engines) -> EngineProcess:
    return real_engines.get("threshold")


@pytest.fixture
def preemption_engine(real_engines) -> EngineProcess:
    return real_engines.get("preemption")
