"""What the user gets back (counterpart of `vllm/outputs.py` and `vllm/logprobs.py`).

A `RequestOutput` is one snapshot of one request: with streaming, `step()`
returns a new one every time a request advances; `finished` is True exactly
once, on the last. `outputs` holds one `CompletionOutput` per sample
(`n > 1` gives n of them, indexed 0..n-1).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token in the processed distribution, its rank
    (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing predicts it), then
# token id -> Logprob for the prompt token itself and the top-N at that position.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that fired

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_in_queue(self) -> float | None:
        s = self.first_scheduled_time
        return None if s is None else s - self.arrival_time

    @property
    def ttft(self) -> float | None:
        t = self.first_token_time
        return None if t is None else t - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        t = self.finished_time
        return None if t is None else t - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs

    def __repr__(self) -> str:
        outs = ", ".join(f"#{o.index} {o.text!r} ({o.finish_reason})" for o in self.outputs)
        return f"RequestOutput({self.request_id!r}, finished={self.finished}, outputs=[{outs}])"
