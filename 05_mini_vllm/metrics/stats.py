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
    spec_decoding_stats: SpecDecodingStats | None = None  # this step's verified drafts, if any


@dataclass
class SpecDecodingStats:
    """Verified drafts over a span (vLLM: `SpecDecodingStats` in
    `vllm/v1/spec_decode/metrics.py`): since the engine started when a worker
    builds it (`Worker.spec_decoding_stats`), one step's when the engine core
    builds it for the stat loggers (`EngineCoreOutputs.spec_decoding_stats`).
    Plain data, so it crosses process bounds.

    A draft sequence is one request's drafts in one verify step (vLLM's
    `num_drafts`; `num_drafts` here predates it and counts draft tokens, vLLM's
    `num_draft_tokens`). Position j counts the sequences with more than j
    drafts, so drafts_per_position[0] == num_draft_sequences, and
    acceptance_per_position[j] = accepted_per_position[j] / drafts_per_position[j]
    is the chance that the first j + 1 drafts are all accepted (vLLM's log line
    divides by num_draft_sequences instead: the same while every sequence has k
    drafts, lower at late positions when some have fewer, as n-gram proposals may).
    mean_acceptance_length = 1 + num_accepted / num_draft_sequences is vLLM's
    tokens per verify step, the bonus (or correction) token included; None
    before any draft sequence, where vLLM leaves it undefined too (its log line
    is skipped and its PromQL ratio is 0 / 0)."""

    num_drafts: int = 0              # draft tokens verified (vLLM: num_draft_tokens)
    num_accepted: int = 0            # of them accepted (vLLM: num_accepted_tokens)
    acceptance_rate: float = 0.0     # num_accepted / num_drafts (0 before any draft)
    acceptance_per_position: list[float] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)    # vLLM: num_draft_tokens_per_pos
    accepted_per_position: list[int] = field(default_factory=list)  # vLLM: num_accepted_tokens_per_pos
    num_draft_sequences: int = 0     # request-steps that verified >= 1 draft (vLLM: num_drafts)
    mean_acceptance_length: float | None = None

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verify step (vLLM's `observe_draft`): `num_draft_tokens` >= 1
        drafts, of which the first `num_accepted_tokens` were accepted. Keeps the
        ratios current, in O(num_draft_tokens)."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens or num_draft_tokens < 1:
            raise ValueError(f"a draft sequence needs 1 <= num_draft_tokens and 0 <= num_accepted_tokens <= "
                             f"num_draft_tokens, got {num_draft_tokens} and {num_accepted_tokens}")
        self.num_draft_sequences += 1
        self.num_drafts += num_draft_tokens
        self.num_accepted += num_accepted_tokens
        grow = num_draft_tokens - len(self.drafts_per_position)
        if grow > 0:
            self.drafts_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
            self.acceptance_per_position += [0.0] * grow
        for j in range(num_draft_tokens):
            self.drafts_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted_tokens
            self.acceptance_per_position[j] = self.accepted_per_position[j] / self.drafts_per_position[j]
        self.acceptance_rate = self.num_accepted / self.num_drafts
        self.mean_acceptance_length = 1 + self.num_accepted / self.num_draft_sequences
