"""A request inside the simulated engine: its sampling parameters, its state in the
scheduler, and the output the HTTP layer reads from it (`SimRequest.drain()`)."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Any

# A `kv_transfer_params` JSON object, as vLLM's NIXL connector reads and writes it.
KvParams = dict[str, Any]


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
        kv_transfer_params: KvParams | None = None,
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
        self.kv_pull: KvParams | None = params if params.get("do_remote_prefill") else None
        self.kv_transfer_params_out: KvParams | None = None
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


__all__ = ["KvParams", "SamplingSpec", "SimRequest", "Status"]
