"""Chapter 5: SamplingParams fields, defaults and validation (vLLM's ranges)."""
import math

import pytest
import torch

from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sampling_params import SamplingParams, SamplingType
from mini_vllm.scheduler import SchedulerSamplingParams

# vLLM's defaults (vllm/sampling_params.py), written out by hand.
VLLM_DEFAULTS = dict(
    n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0, top_p=1.0,
    top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=(), include_stop_str_in_output=False,
    ignore_eos=False, max_tokens=16, min_tokens=0, logprobs=None, skip_special_tokens=True, detokenize=True,
)


def test_defaults_equal_vllm():
    p = SamplingParams()
    for name, want in VLLM_DEFAULTS.items():
        assert getattr(p, name) == want, f"default of {name} differs from vLLM's ({want!r})"
    assert p.sampling_type is SamplingType.RANDOM, "temperature 1 without a seed must be RANDOM"


def test_is_a_scheduler_sampling_params():
    p = SamplingParams(max_tokens=5, stop_token_ids=[7, 8], ignore_eos=True)
    assert isinstance(p, SchedulerSamplingParams), "the Chapter 3 scheduler must accept engine params"
    assert p.stop_token_ids == (7, 8), "stop_token_ids must stay the tuple the scheduler compares against"


# (field, bad value, words the message must contain: field name and allowed range)
BAD = [
    ("n", 0, "[1, 16384]"), ("n", 1.0, "[1, 16384]"), ("n", True, "[1, 16384]"), ("n", 16385, "[1, 16384]"),
    ("temperature", -0.1, "[0, 2]"), ("temperature", math.nan, "[0, 2]"), ("temperature", math.inf, "[0, 2]"),
    ("temperature", "1", "[0, 2]"), ("temperature", 2.01, "[0, 2]"),
    ("top_p", 0.0, "(0, 1]"), ("top_p", 1.01, "(0, 1]"), ("top_p", -0.5, "(0, 1]"),
    ("top_k", -2, ">= 1"), ("top_k", 2.5, ">= 1"), ("top_k", -100, ">= 1"),
    ("min_p", -0.01, "[0, 1]"), ("min_p", 1.5, "[0, 1]"),
    ("presence_penalty", -2.01, "[-2, 2]"), ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3.0, "[-2, 2]"), ("frequency_penalty", 2.01, "[-2, 2]"),
    ("repetition_penalty", 0.0, "> 0"), ("repetition_penalty", -1.0, "> 0"),
    ("max_tokens", 0, ">= 1"), ("max_tokens", 2.0, ">= 1"),
    ("min_tokens", -1, "[0, max_tokens=16]"), ("min_tokens", 17, "[0, max_tokens=16]"),
    ("logprobs", -1, ">= 0"), ("logprobs", 1.5, ">= 0"),
    ("seed", 1.5, "int"), ("seed", "7", "int"),
    # torch's generators and vLLM's API take int64 seeds; a bigger one killed the engine in a step
    ("seed", 2 ** 63, "int64"), ("seed", -(2 ** 63) - 1, "int64"), ("seed", 2 ** 70, "int64"),
    ("stop", ["ok\ud800"], "lone surrogate"), ("bad_words", ["\udfff"], "lone surrogate"),
    ("stop", [""], "non-empty"), ("stop", ["ok", 3], "non-empty"),
    ("stop_token_ids", [-1], ">= 0"),
]


@pytest.mark.parametrize("field,value,allowed", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_value_raises_naming_field_and_range(field, value, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert field in msg and allowed in msg, f"message must name {field} and its range {allowed!r}: {msg!r}"


@pytest.mark.parametrize("field,value", [
    ("top_p", 1.0), ("top_p", 1e-6), ("top_k", -1), ("top_k", 0), ("top_k", 1), ("min_p", 0.0), ("min_p", 1.0),
    ("presence_penalty", -2.0), ("frequency_penalty", 2.0), ("repetition_penalty", 1e-3), ("temperature", 0.0),
    ("logprobs", 0), ("seed", 0), ("min_tokens", 16), ("seed", 2 ** 63 - 1), ("seed", -(2 ** 63)),
    ("temperature", 2.0), ("n", 16384),
])
def test_boundary_values_accepted(field, value):
    SamplingParams(**{field: value})  # the edges of every allowed range are legal


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"], "a single stop string becomes a one-element list"
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"], (
        f"a tuple of stop strings must be stored as a list, got {SamplingParams(stop=('a', 'b')).stop!r}")
    assert SamplingParams(top_k=-1).top_k == 0, "-1 and 0 both disable top-k; one stored form"
    # Greedy ignores the filters (vLLM resets them), including a temperature just under the epsilon.
    for t in (0.0, 5e-6):
        g = SamplingParams(temperature=t, top_k=5, top_p=0.5, min_p=0.3, seed=3)
        assert (g.top_k, g.top_p, g.min_p) == (0, 1.0, 0.0), "greedy requests must drop top-k/top-p/min-p"
        assert g.sampling_type is SamplingType.GREEDY, "temperature < 1e-5 is greedy even with a seed"
    r = SamplingParams(temperature=2e-5, top_k=5)
    assert r.top_k == 5 and r.sampling_type is SamplingType.RANDOM, "temperature >= 1e-5 is random"
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED, (
        "seed=0 must make a sampled request RANDOM_SEED (a seed of 0 taken for no seed?)")


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], seed=4)
    c = p.clone()
    assert c == p and c is not p, "clone must return an equal but distinct SamplingParams"
    c.stop.append("y")
    assert p.stop == ["x"], "clone must not share the stop list with the original"


def test_metadata_builder_checks_and_cheap_greedy_path():
    greedy = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    md = SamplingMetadata.from_params(greedy, [[1], [2]], [[], []], [None, None], [None, None], 8)
    assert md.all_greedy and not md.all_random and md.no_penalties, (
        "an all-greedy batch without penalties must be flagged all_greedy and no_penalties: all_greedy "
        f"{md.all_greedy} all_random {md.all_random} no_penalties {md.no_penalties}")
    assert md.top_k is None and md.top_p is None and md.min_p is None and md.prompt_token_ids is None, \
        "an all-greedy batch without penalties must not build filter or prompt tensors"
    assert torch.equal(md.temperature, torch.zeros(2)), "greedy rows hold temperature 0 exactly"
    with pytest.raises(ValueError, match="generators"):
        SamplingMetadata.from_params([SamplingParams(seed=1)], [[1]], [[]], [None], [None], 8)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingMetadata.from_params([SamplingParams(logprobs=9)], [[1]], [[]], [None], [None], 8)
    with pytest.raises(ValueError, match="eos_token_ids"):
        SamplingMetadata.from_params([SamplingParams()], [[1]], [[]], [None], [], 8)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingMetadata.from_params([SamplingParams()], [[1]], [[]], [None], [None], 0)


# --- What each parameter asks of the engine (mini_vllm.sample.param_effects) -------------
# One request per parameter that changes what is sampled, with that parameter alone in use,
# and whether speculative verification may serve it / sampling reads its output history.
# Written out by hand from what each parameter does, independently of the table.
ONE_PARAM = [  # (kwargs, verifier reproduces it, reads the output history)
    (dict(temperature=0.7), True, False), (dict(top_p=0.9), True, False), (dict(top_k=5), True, False),
    (dict(stop=["x"]), True, False), (dict(n=2), True, False), (dict(prompt_logprobs=1), True, False),
    (dict(max_tokens=3), True, False), (dict(ignore_eos=True), True, False),
    (dict(min_p=0.1), False, False), (dict(seed=3), False, False), (dict(logprobs=0), False, False),
    (dict(logit_bias={5: 1.0}), False, False), (dict(allowed_token_ids=[1, 2]), False, False),
    (dict(presence_penalty=0.5), False, True), (dict(frequency_penalty=0.5), False, True),
    (dict(repetition_penalty=1.2), False, True), (dict(min_tokens=2, max_tokens=4), False, True),
    (dict(bad_words=["x"]), False, True),
]


def test_every_sampling_field_declares_its_effect():
    import dataclasses

    from mini_vllm.sample.param_effects import PARAM_EFFECTS
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(PARAM_EFFECTS) == fields, (
        f"fields without a declared effect: {sorted(fields - set(PARAM_EFFECTS))}; entries for no field: "
        f"{sorted(set(PARAM_EFFECTS) - fields)}: a new sampling parameter must say whether the verifier "
        "reproduces it and whether it reads the output history (sample/param_effects.py)")


@pytest.mark.parametrize("kwargs,spec_ok,history", ONE_PARAM, ids=lambda v: str(v))
def test_param_effects_drive_drafts_and_history(kwargs, spec_ok, history):
    from mini_vllm.sample.param_effects import reads_history
    from mini_vllm.spec_decode.engine.verifier import spec_eligible
    p = SamplingParams(**kwargs)
    assert spec_eligible(p) == spec_ok, (
        f"{kwargs}: drafts {'refused' if spec_ok else 'given'}; a parameter the verifier does not rebuild "
        "would judge drafts under the wrong distribution, and refusing one it does rebuild loses speed")
    assert reads_history(p) == history, (
        f"{kwargs}: reads_history {not history}; a parameter that reads earlier output tokens needs the latest "
        "token on the host before the next step is prepared (async scheduling)")


def test_defaults_and_empty_collections_are_off():
    from mini_vllm.sample.param_effects import reads_history
    from mini_vllm.spec_decode.engine.verifier import spec_eligible
    for p in (SamplingParams(), SamplingParams(stop=[], logit_bias={}, allowed_token_ids=None, top_k=-1)):
        assert spec_eligible(p) and not reads_history(p), \
            f"{p}: a default or empty parameter counted as in use"
    assert not reads_history(SchedulerSamplingParams(min_tokens=3)), \
        "a Chapter 3 scheduler's params (stop rules only) never read the history"
