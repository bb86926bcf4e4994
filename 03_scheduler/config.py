"""Scheduler knobs (counterpart of `SchedulerConfig` in `vllm/config/scheduler.py`).

Invariants checked at construction (each a ValueError naming the field):
* max_num_batched_tokens >= 1: the per-step token budget B;
* max_num_seqs >= 1: at most this many requests hold KV blocks (RUNNING);
* without chunked prefill, B >= max_model_len, otherwise a long prompt (or a
  preempted request recomputing prompt + output) could never be scheduled.
"""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority", "srtf", "two_level")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # > 0: a prefill advances at most this many tokens per step, so one long
    # prompt cannot take the whole budget (0 = no cap).
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    # two_level: size of the FIFO-fed staging queue (seed 001 §4.5.3 suggests 8).
    staging_size: int = 8
    # swap: number of CPU blocks (same block size as the GPU pool).
    num_cpu_blocks: int = 0
    # Asynchronous scheduling (seed 001 §4.6.1): step N + 1 is scheduled before
    # step N's tokens are known; each token in flight is an output placeholder.
    async_scheduling: bool = False
    # Speculative decoding's k (vLLM: num_speculative_tokens). Under asynchronous
    # scheduling each step of a request that samples is followed by one with k
    # placeholder drafts, which the runner fills with the drafts it proposed.
    num_spec_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "staging_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("long_prefill_token_threshold", "num_cpu_blocks", "num_spec_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"(got {self.max_num_batched_tokens} < {self.max_model_len}): a sequence "
                "longer than the budget could never be prefilled")
