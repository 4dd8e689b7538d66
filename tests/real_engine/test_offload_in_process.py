"""The threshold counts the CPU tier: vLLM 0.32's real scheduler, MultiConnector, NIXL and
OffloadingConnector (scheduler side, CPU backend), in-process.

vLLM's OffloadingConnector does not run on the CPU build (its worker stops the engine at
start: "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"), so no real
engine can hold a CPU tier here. This test builds the engine's scheduler exactly as a GPU
engine started by the launcher with `kv_offload_gib` would (ThresholdScheduler with vLLM's
`--kv-transfer-config` MultiConnector JSON from `engine_launcher.commands`) and drives it the
way EngineCore does; a stand-in worker reports every store and load job the connector
schedules as completed (what OffloadingConnectorWorker reports after its copies), and
samples TOKEN for each completed prompt. Everything that decides (the GPU prefix cache, the
offload manager's LRU, MultiConnector's choice, the threshold) is vLLM's own code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

# The in-process harness's fixtures, imported under their own names (an explicit re-export,
# which the linter keeps) so that this module's tests can ask for them.
from support.scheduler_loop import (
    BLOCK,
    MAX_MODEL_LEN,
    TOKEN,
    EngineLoop,
    MakeRequest,
    block_hasher,
    make_request,
    prompt,
)
from support.scheduler_loop import block_hasher as block_hasher
from support.scheduler_loop import make_request as make_request

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput

pytestmark = pytest.mark.real_engine

# 9 GPU blocks: vLLM keeps one as the null block, 8 hold 128 tokens. Running B and C after A
# evicts every block of A from the GPU cache.
GPU_BLOCKS = 9
PROMPT_LEN = 4 * BLOCK


class OffloadWorkerLoop(EngineLoop):
    """EngineLoop whose model-runner output also carries the KV connector's worker side."""

    def __init__(self, scheduler: Scheduler, batch_queue_size: int) -> None:
        super().__init__(scheduler, batch_queue_size)
        self.stored_jobs = 0
        self.loaded_requests: list[str] = []
        # vllm:prompt_tokens_cached_by_source, summed over the stats of every step.
        self.hits_by_source: dict[str, int] = {}
        real_make_stats = scheduler.make_stats

        def make_stats(*args: Any, **kwargs: Any) -> Any:
            stats = real_make_stats(*args, **kwargs)
            if stats is not None and stats.connector_prefix_cache_stats is not None:
                for source, n in stats.connector_prefix_cache_stats.hits_by_source.items():
                    self.hits_by_source[source.value] = self.hits_by_source.get(source.value, 0) + n
            return stats

        # An instance attribute: this scheduler only (what monkeypatch.setattr would do).
        setattr(scheduler, "make_stats", make_stats)  # noqa: B010

    def _model_output(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
            MultiKVConnectorMetadata,
            MultiKVConnectorWorkerMetadata,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        out = super()._model_output(scheduler_output)
        meta = scheduler_output.kv_connector_metadata
        assert isinstance(meta, MultiKVConnectorMetadata)  # the CPU tier's MultiConnector
        offload = next(m for m in meta.metadata if isinstance(m, OffloadingConnectorMetadata))
        done = OffloadingWorkerMetadata()
        for job_id in (*offload.store_jobs, *offload.load_jobs):
            done.mark_completed(job_id)
        self.stored_jobs += len(offload.store_jobs)
        loaded = {job.req_id for job in offload.load_jobs.values()}
        self.loaded_requests += sorted(loaded)
        out.kv_connector_output = KVConnectorOutput(
            finished_recving=loaded or None,
            kv_connector_worker_meta=MultiKVConnectorWorkerMetadata(
                metadata=tuple(done if isinstance(m, OffloadingConnectorMetadata) else None for m in meta.metadata)
            ),
        )
        return out


# make_tiered(cpu_tier, **additional_config): an OffloadWorkerLoop with the CPU tier, else an EngineLoop.
MakeTiered = Callable[..., EngineLoop]


@pytest.fixture
def make_tiered(tiny_model: Path, vllm_plugin: ModuleType, monkeypatch: pytest.MonkeyPatch) -> MakeTiered:
    """make_tiered(cpu_tier: bool, **additional_config): OffloadWorkerLoop with a CPU tier
    (MultiConnector of NIXL and the OffloadingConnector), else EngineLoop (NIXL alone)."""
    from engine_launcher.vllm_plugin.scheduler import ThresholdScheduler
    from support.ports import free_port_below_ephemeral_range

    # NIXL's scheduler side serves its handshake on this port: never a fixed one.
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port_below_ephemeral_range()))

    def make(cpu_tier: bool, **additional_config: Any) -> EngineLoop:
        import torch
        from vllm.config import (
            CacheConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from engine_launcher.commands import kv_transfer_config
        from engine_launcher.host import HostInfo

        # The exact JSON the launcher gives a GPU engine (kv_offload_gib) or one without it.
        kv_json = json.loads(
            kv_transfer_config("both", HostInfo(gpu_count=1), kv_offload_gib=0.01 if cpu_tier else 0.0)
        )
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(tiny_model), max_model_len=MAX_MODEL_LEN, seed=0),
            scheduler_config=SchedulerConfig(
                max_model_len=MAX_MODEL_LEN,
                max_num_seqs=4,
                max_num_batched_tokens=MAX_MODEL_LEN,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(**kv_json),
            additional_config=additional_config,
        )
        vllm_config.cache_config.num_gpu_blocks = GPU_BLOCKS
        kv_cache_config = KVCacheConfig(
            num_blocks=GPU_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
                )
            ],
        )
        scheduler = ThresholdScheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
            log_stats=True,
        )
        return (OffloadWorkerLoop if cpu_tier else EngineLoop)(scheduler, batch_queue_size=1)

    return make


def evict_a_from_gpu(engine: EngineLoop, make_request: MakeRequest, a: list[int]) -> None:
    for rid, p in (("A", a), ("B", prompt(1000, 7 * BLOCK)), ("C", prompt(2000, 7 * BLOCK))):
        engine.add(make_request(rid, p, threshold=0.0, max_tokens=1))
        engine.run_until_idle()
        assert engine.finished(rid).finish_reason is not None
    _, local, _ = engine.scheduler.kv_cache_manager.get_computed_blocks(make_request("lookup", a))
    assert local == 0  # A is gone from the GPU prefix cache


@pytest.mark.parametrize("arrival_check", [True, False], ids=["arrival-on", "arrival-off"])
def test_an_offloaded_prefix_makes_a_probe_accept_that_gpu_only_rejects(
    make_tiered: MakeTiered, make_request: MakeRequest, arrival_check: bool
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
    from vllm.v1.engine import FinishReason

    from engine_launcher.vllm_plugin.stream_patch import REJECTION_MARK

    a = prompt(100, PROMPT_LEN)
    results = {}
    for cpu_tier in (False, True):
        engine = make_tiered(cpu_tier, cache_hit_arrival_check=arrival_check)
        assert isinstance(engine.scheduler.connector, MultiConnector if cpu_tier else NixlBaseConnector)
        evict_a_from_gpu(engine, make_request, a)
        engine.add(make_request("probe", a, threshold=0.75, max_tokens=2))
        engine.run_until_idle()
        results[cpu_tier] = engine
    gpu_only, tiered = results[False], results[True]
    assert isinstance(tiered, OffloadWorkerLoop)

    rejected = gpu_only.finished("probe")
    assert rejected.finish_reason is FinishReason.CACHE_THRESHOLD  # type: ignore[attr-defined]  # a member the plugin adds at run time
    assert rejected.kv_transfer_params is not None
    mark = rejected.kv_transfer_params[REJECTION_MARK]
    assert mark["hit_tokens"] == 0
    assert mark["stage"] == ("arrival" if arrival_check else "admission")

    # The same probe on the engine with a CPU tier: the OffloadingConnector offers A's four
    # stored blocks (its lookup may cover the last token, recomputed after the load), the
    # threshold counts them, the blocks are loaded, and the request runs to its length.
    accepted = tiered.finished("probe")
    assert accepted.finish_reason is FinishReason.LENGTH
    assert tiered.streamed_tokens("probe") == [TOKEN, TOKEN]
    assert tiered.loaded_requests == ["probe"]
    assert tiered.stored_jobs > 0
    # What the API server turns into usage.prompt_tokens_details.cached_tokens (prefill stats:
    # local + external), and vllm:prompt_tokens_cached_by_source: all of it from the host tier.
    prefill = next(o.prefill_stats for o in tiered.outputs["probe"] if o.prefill_stats)
    assert (prefill.num_cached_tokens, prefill.num_local_cached_tokens, prefill.num_external_cached_tokens) == (
        PROMPT_LEN,
        0,
        PROMPT_LEN,
    )
    assert tiered.hits_by_source == {"host": PROMPT_LEN}


def test_arrival_rejection_reports_the_cpu_tier_hit(make_tiered: MakeTiered, make_request: MakeRequest) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.engine import FinishReason

    engine = make_tiered(True)  # arrival check on
    assert isinstance(engine, OffloadWorkerLoop)
    connector = engine.scheduler.connector
    assert isinstance(connector, MultiConnector)  # NIXL and the OffloadingConnector
    a = prompt(100, PROMPT_LEN)
    evict_a_from_gpu(engine, make_request, a)
    offloading = connector.sub_connectors[1]
    assert isinstance(offloading, OffloadingConnector)
    stored_before = offloading.scheduler.manager
    longer = a + prompt(5000, 2 * BLOCK)  # 64 of 96 tokens offloaded: 0.67
    engine.add(make_request("probe", longer, threshold=0.8, max_tokens=2))
    assert "probe" not in engine.scheduler.requests  # rejected inside add_request
    engine.run_until_idle()
    out = engine.finished("probe")
    assert out.finish_reason is FinishReason.CACHE_THRESHOLD  # type: ignore[attr-defined]  # a member the plugin adds at run time
    from engine_launcher.vllm_plugin.stream_patch import REJECTION_MARK

    assert out.kv_transfer_params is not None
    mark = out.kv_transfer_params[REJECTION_MARK]
    assert mark == {"stage": "arrival", "hit_tokens": PROMPT_LEN, "total_tokens": 96, "threshold": 0.8}
    # The arrival lookup loaded nothing and left the offload state alone.
    assert engine.loaded_requests == []
    assert stored_before is offloading.scheduler.manager
