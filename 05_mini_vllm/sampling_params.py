"""Per-request sampling parameters of the engine (vLLM: `vllm/sampling_params.py`).

`SamplingParams` extends Chapter 3's scheduler-facing `SamplingParams`
(max_tokens, stop_token_ids, ignore_eos) with everything the sampler reads,
under vLLM's field names and defaults, so a scheduler built in Chapter 3 keeps
working on engine requests unchanged.

Invariants after construction (each violation is a ValueError naming the
field and its allowed range, checked once here so the sampler never has to):
- n >= 1; temperature >= 0; 0 < top_p <= 1; top_k == -1 or top_k >= 0
  (-1 and 0 both disable top-k; -1 is stored as 0); 0 <= min_p <= 1;
  presence/frequency penalties in [-2, 2]; repetition_penalty > 0;
  max_tokens >= 1; 0 <= min_tokens <= max_tokens; logprobs None or >= 0;
  seed None or an int; `stop` is a list of non-empty strings.
- A request is greedy when temperature < _SAMPLING_EPS. Greedy requests ignore
  top_k, top_p and min_p (they are reset to their disabled values), because
  the argmax of the unfiltered distribution is already the top token.
"""
from __future__ import annotations

import copy
import math
import enum
from dataclasses import dataclass

from mini_vllm.scheduler import SamplingParams as SchedulerSamplingParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5


class SamplingType(enum.IntEnum):
    """How the sampler picks a request's token (vLLM's `SamplingType`)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(x) -> bool:
    # bool is an int subclass; True as a token count or seed is a caller bug.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_range(name: str, value, ok: bool, allowed: str) -> None:
    if not _is_number(value) or not math.isfinite(value) or not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams(SchedulerSamplingParams):
    """Sampling parameters of one request (keyword arguments, as in vLLM)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Inherited: max_tokens=16, stop_token_ids=(), ignore_eos=False.

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        _check_range("temperature", self.temperature, self.temperature >= 0 if _is_number(self.temperature) else False,
                     "a number >= 0 (0 means greedy)")
        _check_range("top_p", self.top_p, 0 < self.top_p <= 1 if _is_number(self.top_p) else False,
                     "in (0, 1] (1 disables top-p)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int, -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0 <= self.min_p <= 1 if _is_number(self.min_p) else False,
                     "in [0, 1] (0 disables min-p)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check_range(name, v, -2 <= v <= 2 if _is_number(v) else False, "in [-2, 2]")
        _check_range("repetition_penalty", self.repetition_penalty,
                     self.repetition_penalty > 0 if _is_number(self.repetition_penalty) else False,
                     "> 0 (1 disables it)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        super().__post_init__()  # normalises stop_token_ids to a tuple
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters cannot change the argmax, so drop them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Stop ids given by the user (EOS is added per request by the engine)."""
        return set(self.stop_token_ids)

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM clones params per request so callers may reuse theirs)."""
        return copy.deepcopy(self)
