"""Threshold schedulers driven in-process, the way vLLM's EngineCore drives them: the
`EngineLoop` harness (a real scheduler, a stand-in model runner) and its fixtures
(`scheduler_cls`, parametrized over both classes, `block_hasher`, `make_engine`,
`make_request`). A test module asks for the fixtures by importing them under their own
names; they need the real_engine conftest's `vllm_plugin` and `tiny_model`."""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # vLLM is imported inside the fixtures (it takes ~15 s)
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

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
