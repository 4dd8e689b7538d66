"""The KV connectors of a simulated engine, as vLLM's MultiConnector of NIXL and the
OffloadingConnector runs them beside the scheduler steps.

- Consumer (decode leg): a NIXL-like pull of the producer's blocks over the side channel,
  costing `kv_transfer_token_s` per token; a failed pull falls back to recompute or ends the
  request with `error`, per `kv_load_failure_policy`.
- Producer (prefill leg): a finished prefill's blocks are kept under a lease until the
  consumer pulls them (`serve_pull`) or the lease expires.
- CPU tier (`cpu_tier.py`): computed prompt blocks are written through to host memory;
  loads back cost `cpu_load_token_s` per token.

Lookup (`hit_tokens`): a decode leg's NIXL pull comes first (it covers the whole prompt past the local hit); otherwise the CPU
tier offers the stored blocks that follow the GPU hit. Either counts as the connector's
("external") tokens: in the threshold, in `cached_tokens`, in
`vllm:external_prefix_cache_hits` and in `vllm:prompt_tokens_cached_by_source` (`p2p` for
NIXL, `host` for the CPU tier, `device` for the GPU prefix cache).

`KvTransferMixin` is a part of `SimEngine` (engine.py): it works on the engine's cache,
queues and counters, declared below for the type checker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .config import SimEngineConfig
from .cpu_tier import CpuTier
from .engine_stats import EngineStats
from .kv_cache import Block, KVCacheManager
from .metrics import EngineMetrics
from .request import KvParams, SimRequest, Status

log = logging.getLogger("engine_launcher.sim")


@dataclass
class Lease:
    blocks: list[Block]
    expiry: float
    num_tokens: int


# (kv_transfer_params, number of tokens) -> True when the producer handed the blocks over.
PullFn = Callable[[KvParams, int], Awaitable[bool]]


class KvTransferMixin:
    """Pulls, leases and CPU-tier loads and stores of a `SimEngine`."""

    # The engine's state this part works on (set by SimEngine.__init__).
    config: SimEngineConfig
    block_size: int
    kv: KVCacheManager
    cpu: CpuTier
    metrics: EngineMetrics
    stats: EngineStats
    engine_id: str
    ready: deque[SimRequest]
    transferring: dict[str, SimRequest]
    leases: dict[str, Lease]
    pull_fn: PullFn | None
    side_channel_host: str
    side_channel_port: int
    _wake: asyncio.Event
    _pull_tasks: set[asyncio.Task[None]]

    def _finish(self, req: SimRequest, reason: str, stop_reason: str | int | None = None) -> None:
        raise NotImplementedError  # SimEngine's

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

    def _start_transfer(self, req: SimRequest, source: str | None, external: int) -> None:
        """Load a transferring request's external tokens beside the steps."""
        load: Awaitable[None]
        if source == "host":
            load = self._load_from_cpu(req, external)
        else:
            params, req.kv_pull = req.kv_pull, None  # NIXL contributes once only
            # hit_tokens offers NIXL tokens only to a request that carries pull params.
            assert params is not None
            load = self._pull(req, params, external)
        task = asyncio.get_running_loop().create_task(load)
        self._pull_tasks.add(task)
        task.add_done_callback(self._pull_tasks.discard)

    async def _pull(self, req: SimRequest, params: KvParams, external: int) -> None:
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

    def _lease(self, req: SimRequest) -> None:
        """Keep a finished prefill leg's blocks for the consumer; its answer names them."""
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


__all__ = ["KvTransferMixin", "Lease", "PullFn"]
