"""Scheduler classes that enforce the cache-hit threshold inside vLLM's engine core.

Select one with `--scheduler-cls`:
  engine_launcher.vllm_plugin.scheduler.ThresholdScheduler       sync scheduling (CPU; GPU
                                                                 with --no-async-scheduling)
  engine_launcher.vllm_plugin.scheduler.ThresholdAsyncScheduler  async scheduling (GPU default)

Two checks, one rule (`threshold.below_threshold`: hit tokens / (prompt + generated) < T):

1. Admission (the final word). vLLM's WAITING loop in `Scheduler.schedule()` computes the
   local prefix hit and the KV connector's tokens for a request whose `num_computed_tokens`
   is 0 (a new request, or a preempted one coming back), then calls
   `self._ec_transfer_pending(request, num_computed_tokens)` before it allocates any block;
   True skips the request for this step. The override returns True for a request below its
   threshold and remembers it; right after `schedule()` returns, those requests are finished
   with RequestStatus.FINISHED_CACHE_THRESHOLD and their EngineCoreOutputs (no new tokens,
   finish reason `cache_threshold`) go out with the next `update_from_output()`, the way
   vLLM reports grammar errors. A preempted request rejected here keeps the tokens it
   generated: the API server already has them (streamed, or accumulated for the final body).

2. Arrival (on by default; `--additional-config '{"cache_hit_arrival_check":
   false}'` turns it off). The WAITING loop only looks at a request once the running set has
   room, so under load a request that is going to be rejected waits in the queue for seconds.
   `add_request` therefore computes the hit rate at once with a read-only lookup:
   `KVCacheManager.get_computed_blocks` (dictionary lookups in the block pool, no ref counts,
   no LRU touch, no stats: vLLM records prefix-cache stats only at admission) plus the KV
   connector's tokens where they can be known without side effects (`offload_lookup`):
   - NIXL: the tokens of a decode leg (`do_remote_prefill`), which its
     `get_num_new_matched_tokens` derives from the prompt length; a request that is not a
     decode leg gets nothing from NIXL;
   - the OffloadingConnector with vLLM's CPU backend (the CPU tier): the stored blocks that
     follow the local hit, read from its manager's dictionary (no LRU touch, no stats);
   - a MultiConnector of those: the first child that offers tokens, as vLLM's MultiConnector.
   With any other connector the arrival check cannot know the external hit and rejects
   nothing (the admission check still applies). A request accepted at arrival is checked
   again at admission; one rejected at arrival never enters the queue.

Prefill legs (`kv_transfer_params.do_remote_decode`) are never rejected.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from . import finish_reason, offload_lookup
from .stream_patch import REJECTION_MARK
from .threshold import PluginConfig, below_threshold, effective_threshold, is_prefill_leg
from .version import check_vllm_version

logger = logging.getLogger("vllm.plugins.cachehit_threshold")

# The mixin goes in front of Scheduler or AsyncScheduler; for the type checker it is a
# Scheduler, so its overrides and the state it reads are checked against vLLM's.
if TYPE_CHECKING:
    _SchedulerBase = Scheduler
else:
    _SchedulerBase = object


class ThresholdSchedulerMixin(_SchedulerBase):
    """Threshold checks on top of a vLLM scheduler class (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Fail at engine start, with a clear message, on a vLLM whose private APIs we have
        # not checked.
        check_vllm_version()
        finish_reason.ensure_extended()
        # Decided inside schedule(), finished right after it: request id -> mark.
        self._threshold_pending: dict[str, dict[str, Any]] = {}
        # Finished, to be reported by the next update_from_output(): (client index, output).
        self._threshold_outputs: list[tuple[int, EngineCoreOutput]] = []
        super().__init__(*args, **kwargs)
        self._threshold_config = PluginConfig.from_additional_config(self.vllm_config.additional_config)
        logger.info(
            "cache-hit threshold scheduler %s: global threshold %.3f, arrival check %s",
            type(self).__name__,
            self._threshold_config.global_threshold,
            "on" if self._threshold_config.arrival_check else "off",
        )

    # ------------------------------------------------------------------ the rule

    def _threshold_for(self, request: Request) -> float:
        params = request.sampling_params
        if params is None or is_prefill_leg(request.kv_transfer_params):
            return 0.0
        return effective_threshold(params.extra_args, self._threshold_config)

    # ------------------------------------------------------------------ admission

    def _ec_transfer_pending(self, request: Request, num_computed_tokens: int) -> bool:
        # Only the fresh-lookup branch: there request.num_computed_tokens is still 0 and
        # num_computed_tokens is local + external hit. The other call (a request that already
        # holds blocks, e.g. after an async KV load) is past admission.
        if request.num_computed_tokens == 0 and request.request_id not in self._threshold_pending:
            threshold = self._threshold_for(request)
            total = request.num_tokens
            if below_threshold(num_computed_tokens, total, threshold):
                stage = "readmission" if request.num_output_tokens > 0 else "admission"
                self._threshold_pending[request.request_id] = _mark(stage, num_computed_tokens, total, threshold)
                return True  # skipped this step; finished after schedule() returns
        return super()._ec_transfer_pending(request, num_computed_tokens)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        output = super().schedule(*args, **kwargs)
        if self._threshold_pending:
            pending, self._threshold_pending = self._threshold_pending, {}
            for request_id, mark in pending.items():
                self._finish_below_threshold(request_id, mark)
        return output

    # ------------------------------------------------------------------ arrival

    def add_request(self, request: Request) -> None:
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if not (is_new and self._threshold_config.arrival_check):
            return
        threshold = self._threshold_for(request)
        if threshold <= 0.0:
            return
        hit = self._arrival_hit_tokens(request)
        if hit is not None and below_threshold(hit, request.num_tokens, threshold):
            self._finish_below_threshold(request.request_id, _mark("arrival", hit, request.num_tokens, threshold))

    def _arrival_hit_tokens(self, request: Request) -> int | None:
        """Local + connector hit without side effects, or None when that cannot be known."""
        manager = self.kv_cache_manager
        if (
            getattr(manager, "enable_kv_cache_events", False)
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            return None  # the lookup would publish BlockStored events
        _, num_local, _ = manager.get_computed_blocks(request)
        if self.connector is None:
            return num_local
        partial_tail = num_local % self.block_size
        aligned = num_local - partial_tail
        external = offload_lookup.external_tokens(self.connector, request, aligned)
        if external is None:
            return None
        # Same combination as the WAITING loop: a remote hit longer than the local
        # sub-block tail supersedes it.
        if partial_tail and external > partial_tail:
            return aligned + external
        if partial_tail:
            return num_local
        return num_local + external

    # ------------------------------------------------------------------ finishing

    def _finish_below_threshold(self, request_id: str, mark: dict[str, Any]) -> None:
        for request in self.finish_requests(request_id, finish_reason.finished_status()):
            logger.debug("request %s below cache-hit threshold: %s", request_id, mark)
            self._threshold_outputs.append(
                (
                    request.client_index,
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=request.get_finished_reason(),
                        events=request.take_events(),
                        trace_headers=request.trace_headers,
                        # Read and removed by the API server (stream_patch): stage for the metric.
                        kv_transfer_params={REJECTION_MARK: mark},
                    ),
                )
            )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._threshold_outputs:
            pending, self._threshold_outputs = self._threshold_outputs, []
            for client_index, engine_output in pending:
                eco = outputs.get(client_index)
                if eco is None:
                    outputs[client_index] = eco = EngineCoreOutputs(outputs=[])
                eco.outputs.append(engine_output)
        return outputs

    def has_requests(self) -> bool:
        # Keep the engine core stepping until every rejection has been reported.
        return bool(self._threshold_outputs) or super().has_requests()


def _mark(stage: str, hit: int, total: int, threshold: float) -> dict[str, Any]:
    return {"stage": stage, "hit_tokens": int(hit), "total_tokens": int(total), "threshold": threshold}


class ThresholdScheduler(ThresholdSchedulerMixin, Scheduler):
    """vLLM's synchronous Scheduler with the cache-hit threshold."""


class ThresholdAsyncScheduler(ThresholdSchedulerMixin, AsyncScheduler):
    """vLLM's AsyncScheduler (GPU default: async scheduling) with the cache-hit threshold."""
