"""What each sampling parameter asks of the engine, declared once for every field.

vLLM counterpart: no single file; vLLM answers the same two questions in several places
(`v1/spec_decode/utils.py`'s eligibility check, the penalties and logits processors of
`v1/sample/`, the async scheduler's output handling). Here one table answers them:

* `reads_history`: sampling reads the request's earlier output tokens (penalties,
  min_tokens, bad words, a grammar). With asynchronous scheduling such a request's
  latest token must reach the host before its next step is prepared.
* `verifier_reproduces`: speculative verification applies the parameter exactly as the
  plain sampler does (temperature, top-k, top-p), or the parameter does not touch the
  sampled distribution (stop strings, detokenization). A request that uses any other
  parameter gets no drafts: a draft would be judged under a different distribution.

A field is in use when its value differs from its default and is not an empty
collection (`stop=[]` and `logit_bias={}` are off, as `None` is). Invariant, checked by
`tests/test_ch5_sampling_params.py`: every field of `SamplingParams` (its own and the
scheduler's it extends) has exactly one entry here, so a new parameter cannot be added
without saying what it asks of the engine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mini_vllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class ParamEffect:
    reads_history: bool = False
    verifier_reproduces: bool = True


_PLAIN = ParamEffect()
_NO_DRAFTS = ParamEffect(verifier_reproduces=False)
_HISTORY = ParamEffect(reads_history=True, verifier_reproduces=False)

PARAM_EFFECTS: dict[str, ParamEffect] = {
    # stop rules: applied to sampled tokens after the step, with or without drafts
    "max_tokens": _PLAIN, "stop_token_ids": _PLAIN, "ignore_eos": _PLAIN, "stop": _PLAIN,
    "include_stop_str_in_output": _PLAIN,
    # EOS and stop ids are masked until the request has min_tokens outputs
    "min_tokens": _HISTORY,
    # what is computed or returned, not what is sampled
    "n": _PLAIN, "prompt_logprobs": _PLAIN, "skip_special_tokens": _PLAIN, "detokenize": _PLAIN,
    "skip_reading_prefix_cache": _PLAIN,
    # the distribution the verifier rebuilds for every draft row
    "temperature": _PLAIN, "top_p": _PLAIN, "top_k": _PLAIN,
    # shape the distribution in ways the verifier does not rebuild
    "min_p": _NO_DRAFTS, "logit_bias": _NO_DRAFTS, "allowed_token_ids": _NO_DRAFTS,
    # a seeded request must give the same tokens with and without speculation, and
    # verification draws its random numbers differently; logprobs would need every draft row's
    "seed": _NO_DRAFTS, "logprobs": _NO_DRAFTS,
    # read the tokens generated so far
    "presence_penalty": _HISTORY, "frequency_penalty": _HISTORY, "repetition_penalty": _HISTORY,
    "bad_words": _HISTORY, "_bad_words_token_ids": _HISTORY, "structured_outputs": _HISTORY,
}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_DEFAULTS = {f.name: _default(f) for f in dataclasses.fields(SamplingParams)}
_HISTORY_FIELDS = tuple((n, _DEFAULTS[n]) for n, e in PARAM_EFFECTS.items() if e.reads_history)
_NO_DRAFT_FIELDS = tuple((n, _DEFAULTS[n]) for n, e in PARAM_EFFECTS.items() if not e.verifier_reproduces)


def in_use(value, default) -> bool:
    if isinstance(value, (list, tuple, dict, set)) and not value:
        return False
    return value is not None and value != default


def uses_any(params: SamplingParams, fields) -> bool:
    return any(in_use(getattr(params, name), default) for name, default in fields)


def reads_history(params) -> bool:
    """Sampling for `params` reads the request's earlier output tokens. A Chapter 3
    scheduler's own params (stop rules only) never do."""
    return isinstance(params, SamplingParams) and uses_any(params, _HISTORY_FIELDS)


def verifier_reproduces(params: SamplingParams) -> bool:
    """Every parameter the request uses is one speculative verification applies exactly."""
    return not uses_any(params, _NO_DRAFT_FIELDS)
