"""The simulated engine core: continuous batching over a paged KV cache, with a timing model.

One asyncio task per engine (`SimEngine._run`) runs scheduler steps, like vLLM's engine
core busy loop; request handlers only enqueue requests and wait on an event, so there is no
task per token or per request in the engine.

A step, as in vLLM V1's `Scheduler.schedule()` (vllm/v1/core/sched/scheduler.py):
1. running requests first, in admission order: each gets the tokens it still needs (the
   rest of its prompt for a chunked prefill, or 1 to decode), within the step's token
   budget (`max_num_batched_tokens`). When the KV cache cannot hold a request's next tokens,
   the most recently admitted running request is preempted (RECOMPUTE: blocks freed, their
   hashes stay cached until evicted, back to the head of the waiting queue) until it fits;
2. if nothing was preempted, waiting requests are admitted in order while the budget and
   `max_num_seqs` allow: prefix-cache lookup, cache-hit threshold check (before any block
   is allocated), then block allocation (a long prompt is prefilled in chunks);
3. the step "runs" for `timing.step_seconds(prefill tokens, decoding sequences) / speed` (x a slowdown fault's);
4. every request whose computed tokens reach its length samples one token.

Timing model (config.py): step time = step_overhead_s + prefill_token_s x tokens prefilled +
decode_seq_s x sequences decoding, divided by `speed`. KV connectors (NIXL, CPU tier):
kv_transfer.py. The cache-hit threshold (its definition: docs/ARCHITECTURE.md) is checked
before any block is allocated, and with `arrival_check` also at arrival (read-only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from . import kv_events
from . import tokenizer as tok
from .config import SimEngineConfig
from .cpu_tier import CpuTier
from .engine_stats import EngineStats
from .generation import Finish, append_next_token, finish_after
from .kv_cache import KVCacheManager, hash_blocks
from .kv_transfer import KvTransferMixin, Lease, PullFn
from .metrics import EngineMetrics
from .request import SimRequest, Status

log = logging.getLogger("engine_launcher.sim")

CACHE_THRESHOLD = "cache_threshold"
# Wall-clock lateness the step loop may catch up on (see SimEngine._run).
MAX_TIME_DEBT_S = 0.1


class SimEngine(KvTransferMixin):
    """One simulated engine core; the HTTP layer (server.py) adds requests and reads them."""

    def __init__(self, config: SimEngineConfig) -> None:
        config.validate()
        self.config = config
        self.block_size = config.block_size
        self.kv = KVCacheManager(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
        self.cpu = CpuTier(config.cpu_offload_tokens // config.block_size if config.enable_prefix_caching else 0)
        self.metrics = EngineMetrics(
            config.model,
            config.block_size,
            config.num_gpu_blocks,
            config.enable_prefix_caching,
            cpu_offload=config.cpu_offload_tokens > 0,
            engine_index=config.data_parallel_rank,
        )
        self.engine_id = str(uuid.uuid4())
        self.requests: dict[str, SimRequest] = {}
        self.waiting: deque[SimRequest] = deque()
        self.ready: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.transferring: dict[str, SimRequest] = {}
        self.leases: dict[str, Lease] = {}
        self.stats = EngineStats()
        # Set by the server: the side-channel client, the address producers advertise, and
        # what to do when the exit fault fires.
        self.pull_fn: PullFn | None = None
        self.side_channel_host = "127.0.0.1"
        self.side_channel_port = 0
        self.on_fatal: Callable[[], None] | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pull_tasks: set[asyncio.Task[None]] = set()
        self._deadline = 0.0
        self._closed = False
        self.dead = False
        self.kv_events = kv_events.attach(self)

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        tasks = [t for t in (self._task, *self._pull_tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for req in list(self.requests.values()):
            self.abort(req.request_id)
        if self.kv_events is not None:
            self.kv_events.close()

    # --- public API used by the HTTP layer --------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.transferring) + len(self.ready)

    def effective_threshold(self, req: SimRequest) -> float:
        if req.is_prefill_leg or not self.config.threshold_plugin:
            return 0.0
        if req.threshold is not None:
            return req.threshold
        return self.config.global_cache_hit_threshold

    def add_request(self, req: SimRequest) -> None:
        """Queue a request (or reject it at once when the arrival check says so)."""
        if self._closed or self.dead:
            raise RuntimeError("engine is not running")
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        req.gen_key = tok.generation_key(self.config.seed, req.sampling.seed, req.prompt_ids)
        hash_blocks(req.all_ids, self.block_size, req.block_hashes, req.lora_name)
        self.requests[req.request_id] = req
        threshold = self.effective_threshold(req)
        if threshold > 0 and self.config.arrival_check:
            _, local, external, _ = self.hit_tokens(req)
            if (local + external) / req.num_tokens < threshold:
                self.stats.arrival_rejections += 1
                self.metrics.threshold_rejections["arrival"].inc()
                # As the plugin: the rejection's usage reports the hit (cached_tokens).
                req.num_cached_tokens = min(local + external, len(req.prompt_ids))
                self._finish(req, CACHE_THRESHOLD)
                return
        self.waiting.append(req)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Client went away: drop the request wherever it is and free its blocks."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.READY:
            self.ready.remove(req)
        elif req.status is Status.TRANSFERRING:
            del self.transferring[request_id]
        self._finish(req, "abort")
        self._wake.set()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.num_requests_running.set(self.num_running)
        m.num_requests_waiting.set(self.num_waiting)
        m.waiting_capacity.set(len(self.waiting))
        m.waiting_deferred.set(len(self.transferring) + len(self.ready))
        m.kv_cache_usage_perc.set(self.kv.usage)

    # --- the loop --------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            if self.kv_events is not None:  # the last step's events, as one batch
                self.kv_events.flush()
            self._expire_leases()
            started = loop.time()
            batch, prefill_tokens, decode_seqs = self._schedule()
            if not batch:
                # Idle, or nothing can be scheduled (blocks held by leases or transfers):
                # sleep until something changes or the next lease expires.
                self._wake.clear()
                self._deadline = 0.0  # idle time is not a debt to catch up on
                timeout = self._next_lease_expiry()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            timed = self.config.timing.step_seconds(prefill_tokens, decode_seqs) * self.config.faults.step_factor
            seconds = timed / self.config.speed
            self.stats.busy_model_seconds += seconds
            # A deadline rather than a plain sleep: oversleeping one step (timer granularity,
            # a busy machine) shortens the next ones, so model time stays accurate on
            # average; a debt above MAX_TIME_DEBT_S (or an idle gap) is forgiven.
            now = loop.time()
            if now - self._deadline > MAX_TIME_DEBT_S:
                self._deadline = now
            self._deadline += seconds
            await asyncio.sleep(max(0.0, self._deadline - now))
            self._apply(batch)
            self.stats.step_count += 1
            # Wall time of busy steps (scheduling included): compared with the modelled time
            # it tells whether the process keeps up with the timing model.
            self.stats.busy_wall_seconds += loop.time() - started
            if self.dead:
                return

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], int, int]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        batch: list[tuple[SimRequest, int]] = []
        while self.ready and len(self.running) < cfg.max_num_seqs:
            req = self.ready.popleft()
            req.status = Status.RUNNING
            self.running.append(req)

        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                batch.append((req, n))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted; it was the last one

        if not preempted:
            self._admit_waiting(batch, budget)
        prefill_tokens = 0
        decode_seqs = 0
        for req, n in batch:
            if n == 1 and req.output_ids and req.num_computed_tokens == req.num_tokens - 1:
                decode_seqs += 1
            else:
                prefill_tokens += n
        return batch, prefill_tokens, decode_seqs

    def _admit_waiting(self, batch: list[tuple[SimRequest, int]], budget: int) -> None:
        cfg = self.config
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            hit, local, external, source = self.hit_tokens(req)
            threshold = self.effective_threshold(req)
            if threshold > 0 and (local + external) / req.num_tokens < threshold:
                self.waiting.popleft()
                self.stats.admission_rejections += 1
                stage = "readmission" if req.num_preemptions else "admission"
                self.metrics.threshold_rejections[stage].inc()
                if req.num_cached_tokens < 0:  # a first rejection reports the hit
                    req.num_cached_tokens = min(local + external, len(req.prompt_ids))
                self._finish(req, CACHE_THRESHOLD)
                continue
            if external:
                if not self.kv.allocate(
                    req.request_id, local + external if source == "host" else len(req.prompt_ids), hit
                ):
                    break
                self.waiting.popleft()
                req.external_source = source
                self._record_hits(req, local, external)
                req.num_computed_tokens = local
                req.num_external_tokens = external
                req.status = Status.TRANSFERRING
                self.transferring[req.request_id] = req
                self._start_transfer(req, source, external)
                continue
            # A decode leg on an engine that already holds the whole prompt pulls nothing.
            req.kv_pull = None
            n = min(req.num_tokens - local, budget)
            if not self.kv.allocate(req.request_id, local + n, hit):
                break
            self.waiting.popleft()
            self._record_hits(req, local, 0)
            req.num_computed_tokens = local
            req.status = Status.RUNNING
            self.running.append(req)
            batch.append((req, n))
            budget -= n

    def _record_hits(self, req: SimRequest, local: int, external: int) -> None:
        if req.num_cached_tokens < 0:  # first admission
            req.num_cached_tokens = local + external
            self.metrics.request_queue_time.observe(time.monotonic() - req.arrival_time)
        if req.num_preemptions:  # vLLM keeps preempted re-admissions out of these counters
            return
        m = self.metrics
        m.prefix_cache_queries.inc(req.num_tokens)
        m.prefix_cache_hits.inc(local)
        m.cached_by_source["device"].inc(local)
        if external or req.num_external_tokens:
            m.external_prefix_cache_queries.inc(req.num_tokens - local)
            m.external_prefix_cache_hits.inc(external)
            if external and req.external_source:
                m.cached_by_source[req.external_source].inc(external)

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.stats.preemptions += 1
        self.metrics.num_preemptions.inc()

    def _apply(self, batch: list[tuple[SimRequest, int]]) -> None:
        cfg = self.config
        any_finished = False
        generated_before = self.stats.total_generated
        for req, n in batch:
            if req.status is not Status.RUNNING:
                continue  # aborted during the step
            req.num_computed_tokens += n
            self.kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
            if self.cpu.enabled and n > 1:  # a prefill (chunk): prompt blocks to store
                self._offload(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a chunk of a longer prefill
            reason = self._sample(req)
            if reason is not None:
                any_finished = True
                self._finish(req, reason[0], reason[1])
            req.event.set()
        if any_finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        self.metrics.generation_tokens.inc(self.stats.total_generated - generated_before)
        exit_after = cfg.faults.exit_after_tokens
        if exit_after and self.stats.total_generated >= exit_after and not self.dead:
            self.dead = True
            log.warning("fault injection: engine dies after %d generated tokens", self.stats.total_generated)
            if self.on_fatal is not None:
                self.on_fatal()

    def _sample(self, req: SimRequest) -> Finish | None:
        """Append one generated token; return (finish_reason, stop_reason) when done."""
        text_before = len(req.output_text)
        token = append_next_token(req, self.config.eos_probability, self.block_size)
        self.stats.total_generated += 1  # vllm:generation_tokens is updated once per step
        m = self.metrics
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            m.time_to_first_token.observe(req.first_token_time - req.arrival_time)
            n_prompt = len(req.prompt_ids)
            m.prompt_tokens.inc(n_prompt)
            cached = min(max(req.num_cached_tokens, 0), n_prompt)
            external = min(req.num_external_tokens, cached) if req.num_cached_tokens > 0 else 0
            m.prompt_tokens_external.inc(external)
            m.prompt_tokens_local_cache_hit.inc(cached - external)
            m.prompt_tokens_local_compute.inc(n_prompt - cached)
        return finish_after(req, token, text_before, self.config.context_len)

    def _finish(self, req: SimRequest, reason: str, stop_reason: str | int | None = None) -> None:
        lease_it = (
            req.is_prefill_leg
            and self.config.produces
            and reason in ("length", "stop")
            and req.request_id in self.kv.req_blocks
        )
        if lease_it:
            self._lease(req)
        else:
            self.kv.free(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.requests.pop(req.request_id, None)
        self.metrics.request_success[reason].inc()
        self.metrics.e2e_request_latency.observe(time.monotonic() - req.arrival_time)
        req.event.set()

    def snapshot(self) -> dict[str, Any]:
        """White-box view for tests and benchmarks."""
        return {
            "running": self.num_running,
            "waiting": self.num_waiting,
            "kv_usage": self.kv.usage,
            "free_blocks": self.kv.num_free_blocks,
            "leases": len(self.leases),
            "steps": self.stats.step_count,
            "generated": self.stats.total_generated,
            "busy_model_seconds": self.stats.busy_model_seconds,
            "busy_wall_seconds": self.stats.busy_wall_seconds,
            "preemptions": self.stats.preemptions,
            "cpu_tier_blocks": len(self.cpu),
        }
