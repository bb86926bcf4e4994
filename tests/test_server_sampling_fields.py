"""The API's sampling fields and the engine's SamplingParams stay one list.

Adding a sampling parameter means declaring it in `sampling_params.py` (with its
effect in `sample/param_effects.py`, checked by `test_ch5_sampling_params.py`) and
using it. This file holds the server to the same declaration: every SamplingParams
field is a request field of the same name, or is listed with its reason in
`protocol.ENGINE_ONLY_SAMPLING_FIELDS`; and a request field's value reaches the
engine (a field the API accepts and then drops would be ignored silently).
"""
import dataclasses

import pytest

from mini_vllm.entrypoints.openai.protocol import (ENGINE_ONLY_SAMPLING_FIELDS, ChatCompletionRequest,
                                                   CompletionRequest)
from mini_vllm.sampling_params import SamplingParams

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}

# One valid value other than the default per request field that maps to a SamplingParams
# field of the same name (the test below fails, naming the field, when one is missing).
NON_DEFAULT = {
    "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 123, "stop": ["\n\n"],
    "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.2, "ignore_eos": True,
    "min_tokens": 2, "stop_token_ids": [7, 9], "include_stop_str_in_output": True,
    "skip_special_tokens": False, "logit_bias": {"11": 2.0}, "allowed_token_ids": [3, 4, 5],
    "bad_words": ["foo"], "structured_outputs": {"regex": "[a-z]{1,3}"}, "max_tokens": 7, "logprobs": 3,
    "prompt_logprobs": 2,
}


# The chat API takes logprobs as OpenAI does (a bool plus top_logprobs, checked below) and offers no
# prompt_logprobs.
CHAT_RENAMED = {"logprobs", "prompt_logprobs"}


def _shared(request_cls) -> set[str]:
    renamed = CHAT_RENAMED if request_cls is ChatCompletionRequest else set()
    return (SAMPLING_FIELDS & set(request_cls.model_fields)) - renamed


def test_every_sampling_field_is_a_request_field_or_declared_engine_only():
    for request_cls in (CompletionRequest, ChatCompletionRequest):
        api = set(request_cls.model_fields)
        renamed = CHAT_RENAMED if request_cls is ChatCompletionRequest else set()
        missing = SAMPLING_FIELDS - api - set(ENGINE_ONLY_SAMPLING_FIELDS) - renamed
        assert not missing, (f"{request_cls.__name__}: SamplingParams fields {sorted(missing)} are neither request "
                             "fields nor in protocol.ENGINE_ONLY_SAMPLING_FIELDS: a new sampling parameter must be "
                             "offered by the API or declared engine-only, with the reason")
    stale = set(ENGINE_ONLY_SAMPLING_FIELDS) - SAMPLING_FIELDS
    assert not stale, f"ENGINE_ONLY_SAMPLING_FIELDS names {sorted(stale)}, which SamplingParams no longer has"
    offered = set(ENGINE_ONLY_SAMPLING_FIELDS) & set(CompletionRequest.model_fields)
    assert not offered, f"{sorted(offered)} are declared engine-only but the API offers them"


@pytest.mark.parametrize("request_cls", [CompletionRequest, ChatCompletionRequest])
def test_each_request_field_reaches_the_engine(request_cls):
    shared = _shared(request_cls)
    assert shared <= set(NON_DEFAULT), (f"no test value for {sorted(shared - set(NON_DEFAULT))}: add a valid "
                                        "non-default value to NON_DEFAULT")
    base = ({"prompt": "x"} if request_cls is CompletionRequest
            else {"messages": [{"role": "user", "content": "x"}]})
    for name in sorted(shared):
        value = NON_DEFAULT[name]
        req = request_cls(**base, **{name: value})
        sp = (req.to_sampling_params(max_model_len=64) if request_cls is CompletionRequest
              else req.to_sampling_params(max_model_len=64, default_max_tokens=16))
        got, default = getattr(sp, name), getattr(SamplingParams(), name)
        assert got != default, (f"{request_cls.__name__}.{name}={value!r} did not reach SamplingParams "
                                f"(it kept the default {default!r}): the API accepts the field and ignores it")


def test_chat_names_reach_the_engine():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3,
                                max_completion_tokens=5)
    sp = req.to_sampling_params(max_model_len=64, default_max_tokens=16)
    assert sp.logprobs == 3, f"chat logprobs=true with top_logprobs=3 must ask the engine for 3, got {sp.logprobs}"
    assert sp.max_tokens == 5, f"chat max_completion_tokens=5 must become max_tokens=5, got {sp.max_tokens}"
