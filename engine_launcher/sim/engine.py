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
3. the step "runs" for `timing.step_seconds(prefill tokens, decoding sequences) / speed`;
4. every request whose computed tokens reach its length samples one token.

Timing model (defaults and their sources: config.py): step time = step_overhead_s +
prefill_token_s x tokens prefilled in the step + decode_seq_s x sequences decoding in it.
A transfer of remote KV costs kv_transfer_token_s per token and runs beside the steps, as
NIXL reads do; a load from the CPU tier (`cpu_tier.py`, vLLM's OffloadingConnector) costs
cpu_load_token_s per token and runs the same way. All durations are divided by `speed`.

KV connectors, as vLLM's MultiConnector of NIXL and the OffloadingConnector: a decode leg's
NIXL pull comes first (it covers the whole prompt past the local hit); otherwise the CPU
tier offers the stored blocks that follow the GPU hit. Either counts as the connector's
("external") tokens: in the threshold, in `cached_tokens`, in
`vllm:external_prefix_cache_hits` and in `vllm:prompt_tokens_cached_by_source` (`p2p` for
NIXL, `host` for the CPU tier, `device` for the GPU prefix cache).

Cache-hit threshold (vLLM RFC 24256, docs/ARCHITECTURE.md): hit rate = (local prefix hit
tokens + tokens the KV connector would pull) / (prompt tokens + tokens already generated);
below the request's threshold the request finishes at once with `cache_threshold`, keeping
any tokens generated before a preemption. Prefill legs are never rejected. With
`arrival_check` the same rate is also computed when the request arrives (read-only lookup)
and a request below it is rejected without queueing; admission stays the final word.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from . import kv_events
from . import tokenizer as tok
from .config import SimEngineConfig
from .cpu_tier import CpuTier
from .kv_cache import Block, KVCacheManager, hash_blocks
from .metrics import EngineMetrics

log = logging.getLogger("engine_launcher.sim")

CACHE_THRESHOLD = "cache_threshold"
# Wall-clock lateness the step loop may catch up on (see SimEngine._run).
MAX_TIME_DEBT_S = 0.1


class Status(enum.Enum):
    WAITING = "waiting"  # in the waiting queue
    TRANSFERRING = "transferring"  # blocks allocated, pulling remote KV (vLLM: WAITING_FOR_REMOTE_KVS)
    READY = "ready"  # transfer done, waiting for a running slot
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    # Number of top logprobs per token (None: no logprobs).
    logprobs: int | None = None


class SimRequest:
    """One request inside the engine; its output is read by the HTTP layer with `drain()`."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        threshold: float | None = None,
        kv_transfer_params: dict | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.all_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.output_logprobs: list[list[tuple[int, float]]] = []
        self.output_text = ""
        self.sampling = sampling
        self.threshold = threshold
        params = kv_transfer_params or {}
        # A prefill leg (P side of NIXL): never rejected, blocks kept under a lease.
        self.is_prefill_leg = bool(params.get("do_remote_decode"))
        # A decode leg (D side): the producer's params, until the one pull attempt.
        self.kv_pull: dict | None = params if params.get("do_remote_prefill") else None
        self.kv_transfer_params_out: dict | None = None
        self.block_hashes: list[int] = []
        # The LoRA adapter the request names (its blocks hash apart from the base model's).
        self.lora_name: str | None = None
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_external_tokens = 0
        # Where the external tokens come from: "p2p" (NIXL pull) or "host" (CPU tier).
        self.external_source: str | None = None
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.gen_key = 0
        # Read side (HTTP layer).
        self.event = asyncio.Event()
        self._sent_tokens = 0
        self._sent_text = 0
        self._holdback = max((len(s) for s in sampling.stop), default=1) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def drain(self) -> tuple[list[int], str, list[list[tuple[int, float]]] | None]:
        """New token ids, text and logprobs since the last call. While a stop string could
        still match, its possible beginning is held back (as vLLM's detokenizer does)."""
        n = len(self.output_ids)
        ids = self.output_ids[self._sent_tokens : n]
        lps = self.output_logprobs[self._sent_tokens : n] if self.sampling.logprobs is not None else None
        self._sent_tokens = n
        end = len(self.output_text)
        if not self.finished and self._holdback:
            end = max(self._sent_text, end - self._holdback)
        text = self.output_text[self._sent_text : end]
        self._sent_text = end
        return ids, text, lps


@dataclass
class Lease:
    blocks: list[Block]
    expiry: float
    num_tokens: int


# (kv_transfer_params, number of tokens) -> True when the producer handed the blocks over.
PullFn = Callable[[dict, int], Awaitable[bool]]


@dataclass
class EngineStats:
    step_count: int = 0
    total_generated: int = 0
    busy_model_seconds: float = 0.0
    busy_wall_seconds: float = 0.0
    leases_expired: int = 0
    failed_pulls: int = 0
    arrival_rejections: int = 0
    admission_rejections: int = 0
    preemptions: int = 0


class SimEngine:
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
        self._task: asyncio.Task | None = None
        self._pull_tasks: set[asyncio.Task] = set()
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

    def hit_tokens(self, req: SimRequest) -> tuple[list[Block], int, int, str | None]:
        """Read-only lookup: (local hit blocks, local hit tokens, external tokens, their
        source: "p2p" for a NIXL pull, "host" for the CPU tier, None)."""
        hit = self.kv.find_cache_hit(req.block_hashes, req.num_tokens)
        local = len(hit) * self.block_size
        if req.kv_pull is not None and self.config.consumes:
            external = max(0, len(req.prompt_ids) - local)
            if external:
                return hit, local, external, "p2p"
        if self.cpu.enabled:
            # The OffloadingConnector offers every stored full block, up to the request's
            # last one (its lookup caps at num_tokens, not num_tokens - 1); the last token is
            # recomputed after the load, as after a NIXL pull.
            stop = req.num_tokens // self.block_size
            offloaded = self.cpu.lookup(req.block_hashes, len(hit), stop) * self.block_size
            if offloaded:
                return hit, local, offloaded, "host"
        return hit, local, 0, None

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

    def serve_pull(self, remote_request_id: str, remote_engine_id: str) -> tuple[bool, str, int]:
        """Producer side of the KV side channel: hand over (release) a leased request's
        blocks. Returns (ok, error message, number of tokens)."""
        if remote_engine_id != self.engine_id:
            return False, f"unknown engine id {remote_engine_id!r}", 0
        lease = self.leases.pop(remote_request_id, None)
        if lease is None:
            return False, f"no KV lease for request {remote_request_id!r} (expired or unknown)", 0
        if lease.expiry < time.monotonic():
            self._expire(lease)
            return False, f"KV lease for request {remote_request_id!r} expired", 0
        self.kv.release(reversed(lease.blocks))
        self._wake.set()
        return True, "", lease.num_tokens

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
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
                continue
            seconds = self.config.timing.step_seconds(prefill_tokens, decode_seqs)
            seconds /= self.config.speed
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
                if source == "host":
                    load = self._load_from_cpu(req, external)
                else:
                    params, req.kv_pull = req.kv_pull, None  # NIXL contributes once only
                    load = self._pull(req, params, external)
                task = asyncio.get_running_loop().create_task(load)
                self._pull_tasks.add(task)
                task.add_done_callback(self._pull_tasks.discard)
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

    async def _pull(self, req: SimRequest, params: dict, external: int) -> None:
        ok = False
        try:
            await asyncio.sleep(external * self.config.timing.kv_transfer_token_s / self.config.speed)
            if self.pull_fn is not None:
                ok = await self.pull_fn(params, external)
        except asyncio.CancelledError:
            raise
        except Exception:  # a pull that fails for any reason falls back to recompute
            log.exception("KV pull for %s failed", req.request_id)
            ok = False
        if req.status is not Status.TRANSFERRING:
            return  # aborted meanwhile
        del self.transferring[req.request_id]
        if not ok and self.config.kv_load_failure_policy == "fail":
            # vLLM's default policy: the request ends with FinishReason.ERROR (an HTTP 500).
            self.stats.failed_pulls += 1
            self.metrics.nixl_num_failed_transfers.inc()
            self._finish(req, "error")
            return
        if ok:
            # As vLLM: with the whole prompt loaded, the last token is recomputed for logits.
            req.num_computed_tokens = min(req.num_computed_tokens + external, req.num_tokens - 1)
            self.kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
        else:
            # Fall back to recomputing the prompt; only the local hit was really cached.
            self.stats.failed_pulls += 1
            self.metrics.nixl_num_failed_transfers.inc()
            req.num_cached_tokens = req.num_computed_tokens
        req.status = Status.READY
        self.ready.append(req)
        self._wake.set()

    async def _load_from_cpu(self, req: SimRequest, tokens: int) -> None:
        """The OffloadingConnector's asynchronous load of CPU-tier blocks into the GPU cache."""
        # Wall-clock seconds, as vLLM's vllm:kv_offload_load_time counts them (a router
        # compares them with the time to first token it observes).
        seconds = tokens * self.config.timing.cpu_load_token_s / self.config.speed
        await asyncio.sleep(seconds)
        if req.status is not Status.TRANSFERRING:
            return  # aborted meanwhile
        del self.transferring[req.request_id]
        start = req.num_computed_tokens // self.block_size
        loaded = req.block_hashes[start : start + tokens // self.block_size]
        self.cpu.load(loaded)
        self.metrics.offload_loaded(tokens * self.config.kv_bytes_per_token, seconds)
        req.num_computed_tokens = min(req.num_computed_tokens + tokens, req.num_tokens - 1)
        self.kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
        req.status = Status.READY
        self.ready.append(req)
        self._wake.set()

    def _offload(self, req: SimRequest) -> None:
        """Write-through to the CPU tier: the prompt's full blocks computed so far."""
        end = min(req.num_computed_tokens, len(req.prompt_ids)) // self.block_size
        new = self.cpu.store(req.block_hashes[:end], req.request_id)
        if new:
            self.metrics.offload_stored(new * self.block_size * self.config.kv_bytes_per_token)

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

    def _sample(self, req: SimRequest) -> tuple[str, str | int | None] | None:
        """Append one generated token; return (finish_reason, stop_reason) when done."""
        cfg = self.config
        sp = req.sampling
        pos = len(req.output_ids)
        allow_eos = not sp.ignore_eos and pos >= sp.min_tokens
        token = tok.next_token(req.gen_key, pos, cfg.eos_probability, allow_eos)
        req.output_ids.append(token)
        req.all_ids.append(token)
        if len(req.all_ids) % self.block_size == 0:  # a block just filled up
            hash_blocks(req.all_ids, self.block_size, req.block_hashes, req.lora_name)
        if sp.logprobs is not None:
            req.output_logprobs.append(tok.fake_logprobs(req.gen_key, pos, token, sp.logprobs))
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
        old_len = len(req.output_text)
        req.output_text += tok.token_text(token) if token != tok.EOS_ID else ""
        n_out = pos + 1
        if token == tok.EOS_ID:
            return "stop", None
        if token in sp.stop_token_ids and n_out >= sp.min_tokens:
            return "stop", token
        if sp.stop and n_out >= sp.min_tokens:
            text = req.output_text
            for s in sp.stop:
                idx = text.find(s, max(0, old_len - len(s) + 1))
                if idx >= 0:
                    req.output_text = text[: idx + len(s)] if sp.include_stop_str_in_output else text[:idx]
                    return "stop", s
        if n_out >= sp.max_tokens or req.num_tokens >= cfg.context_len:
            return "length", None
        return None

    def _finish(self, req: SimRequest, reason: str, stop_reason: str | int | None = None) -> None:
        lease_it = (
            req.is_prefill_leg
            and self.config.produces
            and reason in ("length", "stop")
            and req.request_id in self.kv.req_blocks
        )
        if lease_it:
            blocks = self.kv.take(req.request_id)
            expiry = time.monotonic() + self.config.kv_lease_duration
            self.leases[req.request_id] = Lease(blocks, expiry, req.num_computed_tokens)
            req.kv_transfer_params_out = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[b.block_id for b in blocks]],
                "remote_engine_id": self.engine_id,
                "remote_request_id": req.request_id,
                "remote_host": self.config.advertise_host or self.side_channel_host,
                "remote_port": self.side_channel_port,
                "tp_size": 1,
                "dcp_size": 1,
                "pp_size": 1,
                "remote_num_tokens": req.num_computed_tokens,
                "remote_blocks_expiry_time": None,
                "transfer_mode": "pull",
                "remote_prefill_cached_tokens": max(req.num_cached_tokens, 0),
            }
        else:
            self.kv.free(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.requests.pop(req.request_id, None)
        self.metrics.request_success[reason].inc()
        self.metrics.e2e_request_latency.observe(time.monotonic() - req.arrival_time)
        req.event.set()

    # --- leases ------------------------------------------------------------------------

    def _expire(self, lease: Lease) -> None:
        self.kv.release(reversed(lease.blocks))
        self.stats.leases_expired += 1
        self.metrics.nixl_num_kv_expired_reqs.inc()
        self._wake.set()

    def _expire_leases(self) -> None:
        if not self.leases:
            return
        now = time.monotonic()
        for rid in [rid for rid, lease in self.leases.items() if lease.expiry <= now]:
            log.info("Releasing expired KV blocks for request %s", rid)
            self._expire(self.leases.pop(rid))

    def _next_lease_expiry(self) -> float | None:
        if not self.leases:
            return None
        return max(0.0, min(lease.expiry for lease in self.leases.values()) - time.monotonic())

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
