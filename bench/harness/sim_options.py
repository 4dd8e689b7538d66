"""The flags of every simulated engine a bench cluster starts (`python -m engine_launcher.sim`)."""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "sim-model"


@dataclass
class SimOptions:
    """Flags of every simulated engine (see `python -m engine_launcher.sim --help`)."""

    speed: float = 1.0
    block_size: int = 16
    num_gpu_blocks: int = 28000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    decoder_max_num_batched_tokens: int = 0  # the decode engines' own (0: the same)
    max_model_len: int = 8192  # lowered to what the KV cache holds, as the simulator requires
    prefill_token_s: float | None = None
    kv_transfer_token_s: float | None = None
    # CPU tier of each engine, as a multiple of its GPU KV capacity (0: none), and its load cost.
    cpu_offload_x: float = 0.0
    cpu_load_token_s: float | None = None
    arrival_check: bool = True
    seed: int = 0
    # Decode servers' DP ranks (vLLM --data-parallel-size): KV caches behind each decode port.
    data_parallel_size: int = 1
    # Each decode engine's speed as a share of `speed`, in order (empty: all alike): a fleet
    # of mixed hardware (an engine slowed mid-run is the simulator's slowdown fault instead).
    decoder_speed_factors: tuple[float, ...] = ()
    extra: tuple[str, ...] = ()

    def speed_of(self, decoder: int | None) -> float:
        """The time compression of decode engine `decoder` (its index), or of a producer (None)."""
        if decoder is None or not self.decoder_speed_factors:
            return self.speed
        return self.speed * self.decoder_speed_factors[decoder]

    def args(self, decoder: int | None = None) -> list[str]:
        """`decoder`: a decode engine's index (its own step budget and speed, where set)."""
        budget = (decoder is not None and self.decoder_max_num_batched_tokens) or self.max_num_batched_tokens
        a = [
            "--model",
            MODEL,
            "--speed",
            repr(self.speed_of(decoder)),
            "--block-size",
            str(self.block_size),
            "--num-gpu-blocks",
            str(self.num_gpu_blocks),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(budget),
            "--max-model-len",
            str(min(self.max_model_len, (self.num_gpu_blocks - 1) * self.block_size)),
            "--seed",
            str(self.seed),
            "--arrival-check" if self.arrival_check else "--no-arrival-check",
            "--log-level",
            "warning",
        ]
        if self.prefill_token_s is not None:
            a += ["--prefill-token-s", repr(self.prefill_token_s)]
        if self.kv_transfer_token_s is not None:
            a += ["--kv-transfer-token-s", repr(self.kv_transfer_token_s)]
        if self.cpu_offload_x > 0:
            gpu_tokens = (self.num_gpu_blocks - 1) * self.block_size
            a += ["--cpu-offload-tokens", str(round(self.cpu_offload_x * gpu_tokens))]
            if self.cpu_load_token_s is not None:
                a += ["--cpu-load-token-s", repr(self.cpu_load_token_s)]
        return a + list(self.extra)
