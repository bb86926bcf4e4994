"""The engine's statistics types: what a step, a request and the scheduler report.

vLLM counterpart: `vllm/v1/metrics/stats.py` (`SchedulerStats`,
`IterationStats`, `FinishedRequestStats`, `SpecDecodingStats` in
`vllm/v1/spec_decode/metrics.py`). These are plain records; what consumes
them lives beside this file: `loggers.py` (the engine's running totals and
the periodic log line) and `prometheus.py` (the server's /metrics).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Made by the scheduler that owns the counters (Chapter 3); re-exported for the metrics' readers.
from mini_vllm.scheduler import SchedulerStats  # noqa: F401


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = max(0, min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


@dataclass
class FinishedRequestStats:
    """One finished request (vLLM's `FinishedRequestStats`); times in seconds:
    queue = arrival -> first scheduled, prefill = first scheduled -> first token,
    decode = first token -> last token, inference = first scheduled -> last token."""

    request_id: str
    finish_reason: str | None
    e2e_latency: float
    queue_time: float
    ttft: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    n: int = 1
    max_tokens: int = 0
    max_num_generation_tokens: int = 0  # the longest of the n samples
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0

    @property
    def mean_time_per_output_token(self) -> float:
        per_sample = self.num_generation_tokens / max(self.n, 1)
        return self.decode_time / (per_sample - 1) if per_sample > 1 else 0.0


@dataclass
class IterationStats:
    """What one engine step produced."""

    num_prompt_tokens: int = 0       # prompt tokens computed in this step
    num_generation_tokens: int = 0   # tokens sampled in this step
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class StepStats:
    """What one engine step added, handed to each stat logger of the server
    (`AsyncLLM`, on the event loop; `prometheus.PrometheusStatLogger`)."""

    scheduler_stats: SchedulerStats | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    iteration_tokens: list[int] = field(default_factory=list)


@dataclass
class SpecDecodingStats:
    """Verified drafts since the engine started (vLLM: `SpecDecodingStats` in
    `vllm/v1/spec_decode/metrics.py`), counted in draft tokens. Position j
    counts the verify steps whose request had more than j drafts, so
    acceptance_per_position[j] = accepted_per_position[j] / drafts_per_position[j]
    is the chance that the first j + 1 drafts are all accepted. A worker builds
    it (`Worker.spec_decoding_stats`); plain data, so it crosses process bounds."""

    num_drafts: int = 0              # draft tokens verified
    num_accepted: int = 0            # of them accepted
    acceptance_rate: float = 0.0     # num_accepted / num_drafts (0 before any draft)
    acceptance_per_position: list[float] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def from_counts(cls, num_drafts: int, num_accepted: int, drafts_per_position: list[int],
                    accepted_per_position: list[int]) -> "SpecDecodingStats":
        return cls(num_drafts, num_accepted, num_accepted / num_drafts if num_drafts else 0.0,
                   [a / d for a, d in zip(accepted_per_position, drafts_per_position)],
                   list(drafts_per_position), list(accepted_per_position))
