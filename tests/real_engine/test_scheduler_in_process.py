"""Both threshold schedulers driven in-process: real vLLM 0.32 scheduler, no model, no engine.

ThresholdScheduler and ThresholdAsyncScheduler are built from vLLM's real VllmConfig
(the tiny model's config; no weights are loaded) and a real KVCacheConfig, and driven the
way vLLM's EngineCore drives them: `EngineLoop.step` is `EngineCore.step` for the sync class
and `EngineCore.step_with_batch_queue` with two batches in flight for the async one (what a
GPU engine with async scheduling runs). A stand-in model runner samples TOKEN for every
request whose prompt is complete after the step, nothing for a partial prefill.

The running CPU engine of the other real-engine tests forces synchronous scheduling, so this
is the only place where ThresholdAsyncScheduler runs; every test is parametrized over both
classes because the point is that the plugin behaves the same under both.

These need vLLM importable (~15 s to import), hence the real_engine marker.
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

from router.engine.wire import PREFILL_REQUEST_PARAMS

if TYPE_CHECKING:  # vLLM is imported by the tests themselves (it takes ~15 s)
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

pytestmark = pytest.mark.real_engine

# make_engine(num_blocks=..., max_num_seqs=..., **additional_config) -> EngineLoop
MakeEngine = Callable[..., "EngineLoop"]
# make_request(request_id, prompt, *, threshold=..., max_tokens=..., kv_transfer_params=...)
MakeRequest = Callable[..., "Request"]
BlockHasher = Callable[["Request"], list[Any]]

BLOCK = 16  # tokens per KV block; prefix-cache hits count whole blocks
TOKEN = 7  # what the stand-in model runner samples (not the tiny model's EOS, 1)
MAX_MODEL_LEN = 256
SCHEDULERS = ("ThresholdScheduler", "ThresholdAsyncScheduler")


@pytest.fixture(params=SCHEDULERS)
def scheduler_cls(request: pytest.FixtureRequest, vllm_plugin: ModuleType) -> type[Scheduler]:
    module = importlib.import_module("engine_launcher.vllm_plugin.scheduler")
    cls: type[Scheduler] = getattr(module, request.param)
    return cls


@pytest.fixture(scope="module")
def block_hasher(vllm_plugin: ModuleType) -> BlockHasher:
    # What EngineCore sets up when prefix caching is on (default hash: sha256).
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


@pytest.fixture
def make_engine(scheduler_cls: type[Scheduler], tiny_model: Path) -> MakeEngine:
    """make_engine(num_blocks=..., max_num_seqs=..., **additional_config) -> EngineLoop."""

    def make(num_blocks: int = 64, max_num_seqs: int = 4, **additional_config: Any) -> EngineLoop:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        is_async = issubclass(scheduler_cls, AsyncScheduler)
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(tiny_model), max_model_len=MAX_MODEL_LEN, seed=0),
            scheduler_config=SchedulerConfig(
                max_model_len=MAX_MODEL_LEN,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=MAX_MODEL_LEN,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            additional_config=additional_config,
        )
        # The CPU platform turns async scheduling off while validating the config; a GPU
        # engine running the async class has it on (two batches in flight).
        vllm_config.scheduler_config.async_scheduling = is_async
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
                )
            ],
        )
        scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
            log_stats=True,
        )
        assert vllm_config.max_concurrent_batches == (2 if is_async else 1)
        return EngineLoop(scheduler, batch_queue_size=vllm_config.max_concurrent_batches)

    return make


@pytest.fixture
def make_request(block_hasher: BlockHasher) -> MakeRequest:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    def make(
        request_id: str,
        prompt: list[int],
        *,
        threshold: float | None = None,
        max_tokens: int = 2,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Request:
        extra: dict[str, Any] = {}
        if threshold is not None:
            extra["cache_hit_threshold"] = threshold
        if kv_transfer_params is not None:
            extra["kv_transfer_params"] = kv_transfer_params  # how vLLM's API server passes them
        params = SamplingParams(max_tokens=max_tokens, extra_args=extra or None)
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=block_hasher,
        )

    return make


class EngineLoop:
    """EngineCore's stepping around a scheduler, with a stand-in model runner."""

    def __init__(self, scheduler: Scheduler, batch_queue_size: int) -> None:
        self.scheduler = scheduler
        self.batch_queue_size = batch_queue_size
        self.pool = scheduler.kv_cache_manager.block_pool
        self.queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.schedules: list[SchedulerOutput] = []  # in order
        self.outputs: dict[str, list[EngineCoreOutput]] = {}  # by request id
        self.allocations: list[tuple[str, bool]] = []  # (request id, succeeded)
        manager = scheduler.kv_cache_manager
        real_allocate = manager.allocate_slots

        def allocate_slots(request: Request, *args: Any, **kwargs: Any) -> Any:
            blocks = real_allocate(request, *args, **kwargs)
            self.allocations.append((request.request_id, blocks is not None))
            return blocks

        # An instance attribute: this scheduler only (what monkeypatch.setattr would do).
        setattr(manager, "allocate_slots", allocate_slots)  # noqa: B010

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def _model_output(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(scheduler_output.num_scheduled_tokens)
        # is_prefill_chunk was just set by _update_after_schedule: no token for a partial
        # prefill, one for a completed prompt or a decode step.
        sampled = [[] if self.scheduler.requests[rid].is_prefill_chunk else [TOKEN] for rid in req_ids]
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)}, sampled_token_ids=sampled
        )

    def step(self) -> None:
        # EngineCore.step_with_batch_queue (== EngineCore.step when the queue holds one).
        scheduler = self.scheduler
        if scheduler.has_requests():
            scheduler_output = scheduler.schedule()
            self.schedules.append(scheduler_output)
            self.queue.appendleft((scheduler_output, self._model_output(scheduler_output)))
            if len(self.queue) < self.batch_queue_size and (
                scheduler_output.total_num_scheduled_tokens > 0 or scheduler.has_requests()
            ):
                return
        elif not self.queue:
            return
        scheduler_output, model_output = self.queue.pop()
        for engine_outputs in scheduler.update_from_output(scheduler_output, model_output).values():
            for out in engine_outputs.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)

    def idle(self) -> bool:
        return not self.scheduler.has_requests() and not self.queue

    def run_until_idle(self, max_steps: int = 300) -> None:
        for _ in range(max_steps):
            if self.idle():
                return
            self.step()
        raise AssertionError(f"not idle after {max_steps} steps")

    def finished(self, request_id: str) -> EngineCoreOutput:
        """The request's one finishing output (asserts there is exactly one, and it is last)."""
        outs = self.outputs.get(request_id, [])
        finishing = [o for o in outs if o.finish_reason is not None]
        assert len(finishing) == 1, outs
        assert finishing[0] is outs[-1], outs
        return finishing[0]

    def streamed_tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs.get(request_id, []) for t in o.new_token_ids]

    def first_scheduled_tokens(self, request_id: str) -> int:
        scheduled: int = next(
            s.num_scheduled_tokens[request_id] for s in self.schedules if request_id in s.num_scheduled_tokens
        )
        return scheduled

    def allocated(self, request_id: str) -> bool:
        return any(rid == request_id and ok for rid, ok in self.allocations)


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def assert_rejected(engine: EngineLoop, request_id: str, *, stage: str, hit: int, total: int, threshold: float) -> None:
    from vllm.v1.engine import FinishReason

    from engine_launcher.vllm_plugin.stream_patch import REJECTION_MARK

    out = engine.finished(request_id)
    assert out.finish_reason is FinishReason.CACHE_THRESHOLD  # type: ignore[attr-defined]  # a member the plugin adds at run time
    assert str(out.finish_reason) == "cache_threshold"
    assert out.new_token_ids == []
    assert out.kv_transfer_params == {
        REJECTION_MARK: {"stage": stage, "hit_tokens": hit, "total_tokens": total, "threshold": threshold}
    }
    assert request_id not in engine.scheduler.requests  # finished and freed


def assert_finished_normally(engine: EngineLoop, request_id: str, max_tokens: int) -> None:
    from vllm.v1.engine import FinishReason

    out = engine.finished(request_id)
    assert out.finish_reason is FinishReason.LENGTH
    assert out.kv_transfer_params is None  # no rejection mark (and no connector here)
    assert engine.streamed_tokens(request_id) == [TOKEN] * max_tokens


# --------------------------------------------------------------------------- tests


def test_cold_request_is_rejected_at_arrival_without_blocks(make_engine: MakeEngine, make_request: MakeRequest) -> None:
    engine = make_engine()  # arrival check on by default
    free_before = engine.pool.get_num_free_blocks()
    cold = make_request("cold", prompt(100, 64), threshold=0.5)

    engine.add(cold)
    # Rejected inside add_request: never queued, but the engine keeps stepping until the
    # rejection has been reported.
    assert "cold" not in engine.scheduler.requests
    assert engine.scheduler.get_request_counts() == (0, 0)
    assert engine.scheduler.has_requests()
    assert "cold" not in engine.outputs

    engine.run_until_idle()
    assert_rejected(engine, "cold", stage="arrival", hit=0, total=64, threshold=0.5)
    assert len(engine.outputs["cold"]) == 1
    assert all("cold" not in s.num_scheduled_tokens for s in engine.schedules)
    assert engine.allocations == []  # allocate_slots never ran for it
    assert engine.pool.get_num_free_blocks() == free_before
    # The next schedule() tells the workers it is finished (they drop any state by id).
    assert any("cold" in s.finished_req_ids for s in engine.schedules)


def test_cold_request_is_rejected_at_admission_when_arrival_check_is_off(
    make_engine: MakeEngine, make_request: MakeRequest
) -> None:
    engine = make_engine(cache_hit_arrival_check=False)
    free_before = engine.pool.get_num_free_blocks()
    # The rejected request is first in the queue: it must not hold up the one behind it.
    engine.add(
        make_request("cold", prompt(100, 64), threshold=0.5), make_request("other", prompt(300, 64), threshold=0.0)
    )
    assert engine.scheduler.get_request_counts() == (0, 2)  # both queued: no arrival check

    engine.step()
    first = engine.schedules[0]
    assert first.num_scheduled_tokens == {"other": 64}
    assert "cold" not in engine.scheduler.requests
    # Every block that left the pool belongs to "other"; "cold" never reached allocate_slots.
    other_blocks = engine.scheduler.kv_cache_manager.get_block_ids("other")[0]
    assert free_before - engine.pool.get_num_free_blocks() == len(other_blocks) == 64 // BLOCK
    assert [rid for rid, _ in engine.allocations] == ["other"]

    engine.run_until_idle()
    assert_rejected(engine, "cold", stage="admission", hit=0, total=64, threshold=0.5)
    assert_finished_normally(engine, "other", max_tokens=2)
    assert not engine.allocated("cold")
    assert engine.pool.get_num_free_blocks() == free_before


def test_threshold_zero_or_absent_is_scheduled_normally(make_engine: MakeEngine, make_request: MakeRequest) -> None:
    engine = make_engine()  # global default 0
    engine.add(make_request("zero", prompt(100, 64), threshold=0.0), make_request("absent", prompt(300, 64)))
    engine.run_until_idle()
    for rid in ("zero", "absent"):
        assert engine.first_scheduled_tokens(rid) == 64  # cold: the whole prompt computed
        assert_finished_normally(engine, rid, max_tokens=2)


def test_global_default_applies_unless_the_request_sets_its_own(
    make_engine: MakeEngine, make_request: MakeRequest
) -> None:
    engine = make_engine(global_cache_hit_threshold=0.5)
    engine.add(make_request("absent", prompt(100, 64)), make_request("own-zero", prompt(300, 64), threshold=0.0))
    engine.run_until_idle()
    assert_rejected(engine, "absent", stage="arrival", hit=0, total=64, threshold=0.5)
    assert_finished_normally(engine, "own-zero", max_tokens=2)


@pytest.mark.parametrize("arrival_check", [True, False], ids=["arrival-on", "arrival-off"])
def test_prefix_cache_hit_decides(make_engine: MakeEngine, make_request: MakeRequest, arrival_check: bool) -> None:
    engine = make_engine(cache_hit_arrival_check=arrival_check)
    shared = prompt(100, 4 * BLOCK)  # 64 tokens, four full blocks

    engine.add(make_request("first", shared, threshold=0.0))
    engine.run_until_idle()
    assert_finished_normally(engine, "first", max_tokens=2)
    assert engine.first_scheduled_tokens("first") == 64  # cold

    # The first request's four prompt blocks are now cached, but the last prompt token is
    # always recomputed, so a lookup of the same prompt hits (64 - 1) // 16 = 3 whole
    # blocks: 48 of 64 tokens = 0.75.
    engine.add(make_request("accepted", shared, threshold=0.5), make_request("too-high", shared, threshold=0.8))
    engine.run_until_idle()
    assert engine.first_scheduled_tokens("accepted") == 64 - 48  # only the miss is computed
    assert_finished_normally(engine, "accepted", max_tokens=2)
    assert_rejected(
        engine, "too-high", stage="arrival" if arrival_check else "admission", hit=48, total=64, threshold=0.8
    )
    assert not engine.allocated("too-high")


@pytest.mark.parametrize("arrival_check", [True, False], ids=["arrival-on", "arrival-off"])
def test_prefill_leg_is_never_rejected(make_engine: MakeEngine, make_request: MakeRequest, arrival_check: bool) -> None:
    # Built without a KV connector: vLLM's scheduler only hands kv_transfer_params to a
    # connector, so here they matter to nothing but the plugin's rule (is_prefill_leg), which
    # is what this checks through the real add_request/schedule paths. The NIXL exchange
    # itself is covered by the running-engine tests.
    engine = make_engine(cache_hit_arrival_check=arrival_check)
    prefill_leg = make_request(
        "prefill-leg",
        prompt(100, 64),
        threshold=0.9,
        kv_transfer_params=PREFILL_REQUEST_PARAMS,
    )
    control = make_request("control", prompt(300, 64), threshold=0.9)
    assert prefill_leg.kv_transfer_params is not None
    assert prefill_leg.kv_transfer_params["do_remote_decode"] is True
    from engine_launcher.vllm_plugin.scheduler import ThresholdSchedulerMixin

    assert isinstance(engine.scheduler, ThresholdSchedulerMixin)
    assert engine.scheduler._threshold_for(prefill_leg) == 0.0
    assert engine.scheduler._threshold_for(control) == 0.9

    engine.add(prefill_leg, control)
    engine.run_until_idle()
    assert engine.first_scheduled_tokens("prefill-leg") == 64  # cold, computed in full
    assert_finished_normally(engine, "prefill-leg", max_tokens=2)
    assert_rejected(
        engine, "control", stage="arrival" if arrival_check else "admission", hit=0, total=64, threshold=0.9
    )


def test_preempted_request_below_threshold_is_rejected_at_readmission(
    make_engine: MakeEngine, make_request: MakeRequest
) -> None:
    # 8 blocks, one of which vLLM keeps as the null block: 7 x 16 = 112 token slots for two
    # running requests that each need 3 blocks to start and grow one token per step.
    engine = make_engine(num_blocks=8, max_num_seqs=2)
    assert engine.pool.get_num_free_blocks() == 7
    victim_prompt = prompt(100, 2 * BLOCK + 1)  # 33 tokens: two full blocks + one token

    # Warm the victim's two prompt blocks, so it passes T = 0.9 on arrival and admission
    # (hit 32 of 33).
    engine.add(make_request("warm-up", victim_prompt, threshold=0.0, max_tokens=1))
    engine.run_until_idle()

    survivor = make_request(
        "survivor", prompt(300, 2 * BLOCK + 1), threshold=0.0, max_tokens=60
    )  # 93 tokens at most: fits alone in 6 blocks
    victim = make_request("victim", victim_prompt, threshold=0.9, max_tokens=100)
    engine.add(survivor, victim)

    # Both decode until the pool runs dry; vLLM then preempts the last running request
    # (the victim) when allocate_slots fails, freeing its blocks.
    for _ in range(100):
        engine.step()
        if any("victim" in (s.preempted_req_ids or set()) for s in engine.schedules):
            break
    else:
        pytest.fail("the victim was never preempted")
    allocations_before_preemption = len(engine.allocations)
    assert engine.first_scheduled_tokens("victim") == 1  # admitted on the warm-up's blocks

    engine.run_until_idle()
    streamed = engine.streamed_tokens("victim")
    assert streamed
    assert streamed == [TOKEN] * len(streamed)
    # Back in the queue it counts prompt + generated tokens, while the cache only still
    # holds its two prompt blocks (vLLM frees a request's blocks tail first). Its third
    # block (tokens 32-47) is gone by the time it is rejected: under the sync scheduler it
    # was cached, so the victim passes the re-check (48 of 49) step after step until the
    # survivor's growth evicts that block; the async scheduler caches a block only once the
    # step that computed it has returned, so it was never cached and the first re-check
    # rejects.
    total = len(victim_prompt) + len(streamed)
    assert 0.9 * total > 2 * BLOCK
    assert_rejected(engine, "victim", stage="readmission", hit=2 * BLOCK, total=total, threshold=0.9)
    # It keeps the tokens it generated (the API server already has them) ...
    assert list(victim.output_token_ids) == streamed
    assert victim.num_preemptions == 1
    # ... and never got blocks again after the preemption.
    assert not any(rid == "victim" and ok for rid, ok in engine.allocations[allocations_before_preemption:])
    assert_finished_normally(engine, "survivor", max_tokens=60)
    assert engine.pool.get_num_free_blocks() == 7
