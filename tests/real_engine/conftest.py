"""Fixtures for tests against real vLLM 0.32 engines (CPU build) with the threshold plugin.

- `tiny_model`: the random-weight Llama of engine_launcher.tiny_model, built once per session
  in a temp dir (seconds).
- `real_engines`: the two engines this suite needs, started together (one CPU core each) the
  first time a test asks for either, from the launcher's own command line
  (engine_launcher.commands.vllm_command), and killed as whole process groups when this
  directory's tests end:
    "threshold":  plugin, --additional-config global_cache_hit_threshold 0.5 (arrival check
                  on, the default), --max-num-seqs 2; it is also a NIXL kv_both engine, so it
                  serves prefill legs (do_remote_decode).
    "preemption": plugin, --num-gpu-blocks-override 8 (vLLM keeps one as the null block,
                  so 7 x 32 = 224 tokens: --max-model-len 224), --max-num-seqs 2,
                  arrival check off.
  Starting both together costs one start-up (~30-150 s on this machine) instead of two.
  Once healthy, one NIXL prefill/decode exchange each way does the handshakes (see
  EngineSet._warm_nixl).
- `kv_events_engine`: one engine publishing its KV-cache events (ZMQ PUB and replay
  sockets), for test_kv_events_real.py alone (module scope: stopped when that file ends,
  which runs, by name, before any test starts the two shared engines).
- CACHEHIT_ENGINE_LOG_DIR=dir keeps the engines' logs there instead of in a temp dir.
- CACHEHIT_REQUIRE_REAL_ENGINE=1 (CI): an engine that cannot start fails the tests;
  otherwise they are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest

from router.engine.wire import PREFILL_REQUEST_PARAMS
from support.ports import free_port_below_ephemeral_range
from support.real_engine import (
    EngineProcess,
    EngineStartError,
    engine_command,
    post_json,
    vllm_missing_reason,
)
from support.requirements import missing_dependency

NIXL_WARMUP_ATTEMPTS = 3
STARTUP_TIMEOUT_S = float(os.environ.get("CACHEHIT_ENGINE_STARTUP_TIMEOUT", "420"))

# Eager sampler kernels: the first logprobs request would otherwise compile one with
# inductor + g++ (minutes on two busy cores); see docs/VLLM_WIRE.md.
ENGINE_ENV = {"TORCHDYNAMO_DISABLE": "1"}

ENGINE_SPECS: dict[str, dict[str, Any]] = {
    "threshold": dict(
        cpu_cores=(0,),
        extra_args=(
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "2",
            "--additional-config",
            json.dumps({"global_cache_hit_threshold": 0.5}),
        ),
    ),
    "preemption": dict(
        cpu_cores=(1,),
        extra_args=(
            "--max-model-len",
            "224",
            "--max-num-seqs",
            "2",
            "--num-gpu-blocks-override",
            "8",
            "--additional-config",
            json.dumps({"cache_hit_arrival_check": False}),
        ),
    ),
}


def _unavailable(reason: str) -> NoReturn:
    missing_dependency(reason)


@pytest.fixture(scope="session")
def engine_workdir() -> Iterator[Path]:
    # CACHEHIT_ENGINE_LOG_DIR keeps the engines' logs (and the tiny model) after the run.
    keep = os.environ.get("CACHEHIT_ENGINE_LOG_DIR")
    if keep:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="cachehit-real-engine-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def vllm_plugin() -> ModuleType:
    """The threshold plugin registered in this process, as vLLM's plugin loader does (no
    engine started); fails in CI and skips elsewhere when vLLM is not importable."""
    reason = vllm_missing_reason()
    if reason:
        _unavailable(reason)
    from engine_launcher import vllm_plugin as plugin

    plugin.register()
    return plugin


@pytest.fixture(scope="session")
def tiny_model(engine_workdir: Path) -> Path:
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
        port = free_port_below_ephemeral_range()
        argv, env = engine_command(
            self.model_dir,
            name=name,
            port=port,
            nixl_port=free_port_below_ephemeral_range(),
            role="both",
            cpu_cores=spec["cpu_cores"],
            extra_args=spec["extra_args"],
            env=ENGINE_ENV,
            log_dir=self.workdir,
        )
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
                print(f"\n[real engine] {name}: healthy after {took:.1f} s ({engine.base_url}, log {engine.log_path})")
            self._warm_nixl()
        except (EngineStartError, OSError) as exc:
            self.error = f"a real vLLM engine did not start: {exc}"
            self.stop_all()

    def _warm_nixl(self) -> None:
        """One prefill/decode exchange each way, so that every test finds the NIXL handshake
        done. vLLM 0.32 gives the first handshake between two engines 5 s (a ZMQ receive
        timeout) and fails the request when it runs out, which a loaded two-core machine can
        make happen; the handshake is kept once it succeeds. What a failed transfer does is
        tested on its own (test_failed_kv_load_ends_the_decode_leg_with_an_internal_error)."""
        engines = list(self.engines.values())
        for producer, consumer in ((engines[0], engines[1]), (engines[1], engines[0])):
            for attempt in range(1, NIXL_WARMUP_ATTEMPTS + 1):
                t0 = time.monotonic()
                status, answer = post_json(
                    producer.base_url,
                    "/v1/completions",
                    {
                        "model": "tiny",
                        "prompt": f"nixl warm-up {attempt}",
                        "max_tokens": 1,
                        "kv_transfer_params": PREFILL_REQUEST_PARAMS,
                    },
                    timeout=120,
                )
                if status != 200 or not (answer.get("kv_transfer_params") or {}).get("do_remote_prefill"):
                    raise EngineStartError(f"prefill leg on {producer.base_url} failed: {status} {answer}")
                status, out = post_json(
                    consumer.base_url,
                    "/v1/completions",
                    {
                        "model": "tiny",
                        "prompt": f"nixl warm-up {attempt}",
                        "max_tokens": 1,
                        "kv_transfer_params": answer["kv_transfer_params"],
                    },
                    timeout=120,
                )
                took = time.monotonic() - t0
                print(
                    f"\n[real engine] NIXL {producer.base_url} -> {consumer.base_url}: "
                    f"attempt {attempt}, HTTP {status} in {took:.1f} s"
                )
                if status == 200:
                    break
            else:
                raise EngineStartError(
                    f"no NIXL transfer {producer.base_url} -> {consumer.base_url} succeeded in "
                    f"{NIXL_WARMUP_ATTEMPTS} attempts; last answer {status} {out}\n"
                    f"{consumer.log_tail()}"
                )

    def get(self, name: str) -> EngineProcess:
        if not self.started:
            self.start_all()
        if self.error:
            _unavailable(self.error)
        engine = self.engines[name]
        if engine.proc is None or engine.proc.poll() is not None:
            pytest.fail(
                f"engine {name} died (code {engine.proc.returncode if engine.proc else None}):\n{engine.log_tail()}",
                pytrace=False,
            )
        return engine

    def stop_all(self) -> None:
        for engine in self.engines.values():
            engine.stop()


@pytest.fixture(scope="package")
def real_engines(tiny_model: Path, engine_workdir: Path) -> Iterator[EngineSet]:
    # Package scope: the engines (about 3 GB and an OpenMP thread pool each) stop when this
    # directory's tests end; left running, they slowed every later suite on two cores.
    engines = EngineSet(tiny_model, engine_workdir)
    try:
        yield engines
    finally:
        engines.stop_all()


@pytest.fixture(scope="module")
def kv_events_engine(tiny_model: Path, engine_workdir: Path) -> Iterator[EngineProcess]:
    """An engine with KV-cache events on: `extra["kv_events_endpoint"]` and
    `extra["kv_events_replay_endpoint"]` are where a router on this host subscribes.
    VLLM_SERVER_DEV_MODE=1 serves vLLM's POST /reset_prefix_cache."""

    def spawn(attempt: int) -> EngineProcess:
        port, pub, replay = (free_port_below_ephemeral_range() for _ in range(3))
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        argv, env = engine_command(
            tiny_model,
            name="kv-events",
            port=port,
            nixl_port=free_port_below_ephemeral_range(),
            cpu_cores=(0,),
            extra_args=(
                "--max-model-len",
                "512",
                "--max-num-seqs",
                "2",
                "--kv-events-config",
                json.dumps(events),
            ),
            env={**ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1"},
            log_dir=engine_workdir,
        )
        name = "kv-events.log" if attempt == 0 else f"kv-events.retry{attempt}.log"
        engine = EngineProcess(argv, env, port, engine_workdir / name)
        engine.extra.update(
            kv_events_endpoint=f"tcp://127.0.0.1:{pub}", kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}"
        )
        return engine.start()

    engine = spawn(0)
    try:
        try:
            try:
                took = engine.wait_healthy(STARTUP_TIMEOUT_S)
            except EngineStartError as exc:
                # A port picked free can be taken before vLLM binds it: retry that once.
                if "Address already in use" not in str(exc):
                    raise
                engine.stop()
                engine = spawn(1)
                took = engine.wait_healthy(STARTUP_TIMEOUT_S)
        except (EngineStartError, OSError) as exc:
            _unavailable(f"the KV-events vLLM engine did not start: {exc}")
        print(f"\n[real engine] kv-events: healthy after {took:.1f} s ({engine.base_url}, log {engine.log_path})")
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def threshold_engine(real_engines: EngineSet) -> EngineProcess:
    return real_engines.get("threshold")


@pytest.fixture
def preemption_engine(real_engines: EngineSet) -> EngineProcess:
    return real_engines.get("preemption")


@pytest.fixture
def spare_engine(real_engines: EngineSet, tiny_model: Path, engine_workdir: Path) -> Iterator[EngineProcess]:
    """A third engine, started for one test and stopped after it, for tests that leave an
    engine in a state the shared ones must not be in. A NIXL handshake with an unreachable
    peer is one: vLLM keeps retrying it in the background, and an engine here stopped
    answering HTTP for ~18 s after two of them (CI's next test then timed out)."""
    real_engines.get("threshold")  # the shared engines start first (and fail first)
    port = free_port_below_ephemeral_range()
    argv, env = engine_command(
        tiny_model,
        name="spare",
        port=port,
        nixl_port=free_port_below_ephemeral_range(),
        role="both",
        cpu_cores=(1,),
        extra_args=("--max-model-len", "512", "--max-num-seqs", "2"),
        env=ENGINE_ENV,
        log_dir=engine_workdir,
    )
    engine = EngineProcess(argv, env, port, engine_workdir / "spare.log").start()
    try:
        try:
            took = engine.wait_healthy(STARTUP_TIMEOUT_S)
        except EngineStartError as exc:
            _unavailable(f"the spare vLLM engine did not start: {exc}")
        print(f"\n[real engine] spare: healthy after {took:.1f} s ({engine.base_url})")
        yield engine
    finally:
        engine.stop()
