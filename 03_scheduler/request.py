"""A request as the scheduler sees it (counterpart of `vllm/v1/request.py`).

The whole scheduling state of a request is two numbers (seed 001 §4.4.2):

* `num_tokens`          = len(prompt) + len(output so far)  ("num_total_tokens")
* `num_computed_tokens` = tokens whose KV is already in the cache

Invariant: 0 <= num_computed_tokens <= num_tokens + len(spec_token_ids).
Every scheduling behaviour (prefill, decode, chunked prefill, prefix hit,
preemption, speculative decoding) is an update of these two numbers
(seed 001 Table 4.1).

The attributes read by Chapter 2's `KVCacheManager` (duck-typed) are
`request_id`, `all_token_ids`, `num_prompt_tokens`, `num_tokens`,
`num_computed_tokens` and `cache_salt`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

# A token id that is no token (vLLM's name): a draft scheduled before it is known
# (asynchronous scheduling), or padding after a verified request's emitted tokens
# (Chapter 4's rejection sampler, which imports it from here).
PLACEHOLDER_TOKEN_ID = -1


class RequestStatus(enum.IntEnum):
    """Life cycle: WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED_*.

    Ordered so that every status > PREEMPTED is a finished one (as in vLLM).
    """

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token id
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()  # finish_requests(...) from the outside

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class SchedulerSamplingParams:
    """The part of sampling that the scheduler needs: when to stop.

    Not vLLM's `SamplingParams`: Chapter 5's `SamplingParams` (vLLM's fields) extends
    this class with what the sampler reads, so a Chapter 3 scheduler runs engine
    requests unchanged.

    max_tokens: cap on generated tokens (>= 1).
    stop_token_ids: generating any of these finishes the request ("stop").
    ignore_eos: when True, the EOS token does not stop generation.
    min_tokens: EOS and stop ids do not count before this many tokens.
    skip_reading_prefix_cache: compute the whole prompt even when it is cached
      (Chapter 5 sets it for prompt logprobs: cached blocks have no logits).
    """

    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_reading_prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


class Request:
    """One generation request.

    `all_token_ids` is prompt + output; it is a list owned by the request and
    only ever appended to (or truncated on a speculative rollback), so the KV
    manager may keep reading it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SchedulerSamplingParams | None = None,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        spec_decode: bool = True,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-empty")
        self.request_id = str(request_id)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params or SchedulerSamplingParams()
        self.eos_token_id = eos_token_id
        self.arrival_time = float(arrival_time)
        # Lower value = served first (vLLM's convention).
        self.priority = int(priority)
        self.cache_salt = cache_salt

        self.status = RequestStatus.WAITING
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens found computed (prefix cache, KV connector) when first scheduled;
        # -1 until then. Reported back in every output, as vLLM's `num_cached_tokens`.
        self.num_cached_tokens = -1
        # Draft tokens proposed for the next step (Chapter 4 fills this).
        self.spec_token_ids: list[int] = []
        # False: drafts are never scheduled for it (the engine's verifier cannot
        # reproduce its sampling: a seed, logprobs, penalties...), so asynchronous
        # scheduling gives it no placeholder drafts either.
        self.spec_decode = bool(spec_decode)
        self.num_preemptions = 0
        # Swap preemption: CPU blocks holding this request's KV while swapped out.
        self.swapped_cpu_block_ids: list[int] = []
        # How many of `all_token_ids` the runner has been sent (None: the
        # runner has never seen this request): the next CachedRequestData
        # carries the rest as `new_token_ids`, so a runner learns every token
        # from SchedulerOutputs alone.
        self.num_tokens_sent: int | None = None
        # Asynchronous scheduling: tokens sampled by steps already scheduled but
        # not yet back (each one's position is computed ahead, its id unknown).
        # Always 0 when the scheduler waits for every step (the default).
        self.num_output_placeholders = 0

    # --- the two numbers and their views -------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """True for a request that must compute every prompt token itself (vLLM:
        prompt logprobs need the logits of cached tokens too); its blocks are
        still cached for others."""
        return bool(self.sampling_params.skip_reading_prefix_cache)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")


@dataclass
class EngineCoreOutput:
    """What one step produced for one request (cf. `vllm/v1/engine/__init__.py`)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_rejected_spec_tokens: int = 0
    num_cached_tokens: int = 0
    # Filled by the engine core (Chapter 5) from the runner's output, for requests
    # that asked: one (token_ids, logprobs, sampled_rank) per new token, and the
    # prompt's (token_ids, logprobs, ranks) once, on the step that completes it.
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
