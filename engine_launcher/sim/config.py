"""Configuration of one simulated engine.

`SimEngineConfig` is the one place every knob lives; the CLI (`cli.py`) maps flags to it
one to one and the in-process API (`start_sim_engine`) takes it directly.

Default timing constants model **Llama-3.1-8B-Instruct in BF16 on one H100 SXM 80GB with
vLLM (V1 engine, chunked prefill, prefix caching)**. They are approximations derived from
public figures, not measurements of ours:

- decode step overhead 6 ms: at batch 1 a decode step must stream the 16 GB of weights
  from HBM (3.35 TB/s: ~4.8 ms) plus scheduler/sampler/launch overhead; vLLM's published
  serving benchmarks for 8B models on H100 report ITL of roughly 6-8 ms at low load;
- 50 us per prefilled token (~20k prompt tokens/s per GPU): 8B parameters cost ~16 GFLOP
  per token; at the ~300-400 TFLOP/s that vLLM reaches in large prefill batches that is
  40-55 us/token, in line with published prefill throughput of 15-25k tokens/s;
- 60 us per running sequence per step: the attention/KV-read and sampling cost that makes
  ITL grow to ~20 ms at batch 256 in published throughput runs;
- 4 us per token of KV transferred over NIXL: the KV of one token of Llama-3.1-8B is
  128 KiB (32 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes); at ~30 GB/s effective
  RDMA bandwidth that is ~4 us/token;
- 2.6 us per token loaded from the CPU tier (vLLM's OffloadingConnector, host DRAM to HBM):
  128 KiB per token over PCIe Gen5 x16 (64 GB/s per direction, about 50 GB/s achieved by
  pinned-memory copies on H100 hosts) is 2.6 us/token, 19x cheaper than recomputing it at
  50 us/token; on a Grace Hopper superchip (NVLink-C2C, 450 GB/s per direction) it would be
  about 0.3 us/token (`--cpu-load-token-s 0.0000003`);
- 28,000 blocks of 16 tokens (448k tokens): ~55 GiB of KV cache left on an 80 GB GPU at
  gpu_memory_utilization 0.9 after 16 GB of weights and activations, at 128 KiB/token;
- max_num_seqs 256 and max_num_batched_tokens 8192: vLLM V1 defaults for an online server
  on a large GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .kv_events import KVEventsConfig

ROLES = ("producer", "consumer", "both")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
VLLM_VERSION = "0.32.0"


@dataclass(frozen=True)
class TimingModel:
    """step time = step_overhead_s + prefill_token_s * prefill tokens
    + decode_seq_s * decoding sequences; all divided by the engine's speed factor."""

    step_overhead_s: float = 0.006
    prefill_token_s: float = 0.000050
    decode_seq_s: float = 0.000060
    kv_transfer_token_s: float = 0.000004
    cpu_load_token_s: float = 0.0000026

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.step_overhead_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs


@dataclass
class FaultConfig:
    """Fault injection; mutable at runtime through `POST /_sim/faults` (with --enable-admin).

    0 disables each fault.
    """

    # Fraction of requests (generation, embeddings, tokenize, audio) answered with HTTP 500 before any work.
    error_rate: float = 0.0
    # After this many generated tokens (engine-wide), the engine dies: the CLI process
    # exits; an in-process engine drops every connection and stops serving.
    exit_after_tokens: int = 0
    # Each stream pauses for stall_seconds (real seconds, not scaled by speed) once it has
    # sent this many tokens.
    stall_after_tokens: int = 0
    stall_seconds: float = 0.0
    # Every engine step takes this many times what the timing model says: a GPU shared with
    # another tenant, or throttled; set at runtime, it is an engine slowing down mid-run.
    slowdown: float = 0.0

    @property
    def step_factor(self) -> float:
        return self.slowdown or 1.0

    def validate(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"fault error_rate must be in [0, 1], got {self.error_rate}")
        if min(self.exit_after_tokens, self.stall_after_tokens, self.stall_seconds, self.slowdown) < 0:
            raise ValueError("fault counts, durations and the slowdown must be >= 0")


@dataclass
class SimEngineConfig:
    """Everything one simulated engine needs. See docs/SIMULATOR.md for each field."""

    model: str = "sim-model"
    role: str = "both"  # producer | consumer | both (NIXL kv_role)
    max_model_len: int = 8192
    block_size: int = 16
    num_gpu_blocks: int = 28000
    # CPU tier (vLLM's OffloadingConnector): host memory for this many tokens; 0: none.
    cpu_offload_tokens: int = 0
    # Bytes of KV per token of the simulated model (Llama-3.1-8B, BF16), for the offload
    # byte counters and the launcher's kv_offload_gib.
    kv_bytes_per_token: int = 131072
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    # Time compression: speed 100 runs the timing model 100x faster.
    speed: float = 1.0
    timing: TimingModel = field(default_factory=TimingModel)
    # Seed of the deterministic token generator (combined with each request's seed).
    seed: int = 0
    # Probability that a generated position is EOS (never before min_tokens, never with
    # ignore_eos). 0: outputs always run to max_tokens or a stop string.
    eos_probability: float = 0.0
    # Cache-hit threshold (vLLM RFC 24256).
    global_cache_hit_threshold: float = 0.0
    # False: act as a stock vLLM without the threshold plugin: `cache_hit_threshold` (top
    # level or in vllm_xargs) is ignored unchecked and no request is ever rejected.
    threshold_plugin: bool = True
    arrival_check: bool = True
    # NIXL-like prefill/decode.
    kv_lease_duration: float = 30.0
    # What a consumer does when a pull fails (vLLM's kv_transfer_config.kv_load_failure_policy):
    # "fail" (vLLM's default) ends the request with finish reason "error", an HTTP 500;
    # "recompute" computes the prompt locally instead.
    kv_load_failure_policy: str = "fail"
    # Host named in remote_host of a producer's kv_transfer_params ("" = the bound host).
    advertise_host: str = ""
    # vLLM only fills usage.prompt_tokens_details with --enable-prompt-tokens-details;
    # the router needs cached_tokens, so the simulator behaves as if that flag were set.
    enable_prompt_tokens_details: bool = True
    max_logprobs: int = 20
    faults: FaultConfig = field(default_factory=FaultConfig)
    # Enables POST /_sim/faults (runtime fault changes).
    enable_admin: bool = False
    # LoRA adapters served besides the model: name -> path (vLLM's --lora-modules); also
    # loaded and unloaded at runtime with POST /v1/load_lora_adapter, /v1/unload_lora_adapter.
    # The simulator has no weights: an adapter answers as the base model does.
    lora_modules: dict[str, str] = field(default_factory=dict)
    # Seconds (at speed 1) a runtime load takes before it answers: reading the weights.
    lora_load_s: float = 0.0
    # vLLM's --kv-events-config (kv_events.py): the KV cache event stream; None: off.
    kv_events_config: KVEventsConfig | None = None
    # vLLM's --data-parallel-size: engine cores behind the one port (data_parallel.py), and
    # the rank of one of them (set per rank by the server).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        for name in ("max_model_len", "block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_size must be >= 1 and above the rank, got {self.data_parallel_size} "
                f"(rank {self.data_parallel_rank})"
            )
        if self.lora_load_s < 0:
            raise ValueError(f"lora_load_s must be >= 0, got {self.lora_load_s}")
        if self.cpu_offload_tokens < 0:
            raise ValueError(f"cpu_offload_tokens must be >= 0, got {self.cpu_offload_tokens}")
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        if self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is vLLM's null block)")
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0, got {self.speed}")
        if not 0.0 <= self.global_cache_hit_threshold <= 1.0:
            raise ValueError("global_cache_hit_threshold must be in [0, 1]")
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError("eos_probability must be in [0, 1]")
        if self.kv_lease_duration <= 0:
            raise ValueError("kv_lease_duration must be > 0")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of "
                f"{', '.join(KV_LOAD_FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}"
            )
        for f in dataclasses.fields(TimingModel):
            if getattr(self.timing, f.name) < 0:
                raise ValueError(f"timing.{f.name} must be >= 0")
        self.faults.validate()
        if self.kv_events_config is not None:
            self.kv_events_config.validate()

    @property
    def context_len(self) -> int:
        """The context a request may use: max_model_len, or less when the KV cache is
        smaller. vLLM refuses such a cache at start-up; the simulator allows it (tests use
        tiny caches to force preemption) and caps requests so one always fits alone."""
        return min(self.max_model_len, (self.num_gpu_blocks - 1) * self.block_size)

    @property
    def produces(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("consumer", "both")
