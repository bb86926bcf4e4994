"""Bad input: a clear error naming the field and its allowed range, and the
engine keeps serving everyone else."""
import json
import re

import pytest

from engine_utils import assert_pool_full, make_llm, run_greedy
from mini_vllm import LLM, SamplingParams
from mini_vllm.models import MODEL_REGISTRY


@pytest.fixture(scope="module")
def llm():
    return make_llm(block_size=8, max_model_len=128)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, match", [
    ("", "at least 1 token"),
    ({"prompt_token_ids": []}, "at least 1 token"),
    ({"prompt_token_ids": [1, 2, 6144]}, r"prompt_token_ids must lie in \[0, 6144\)"),
    ({"prompt_token_ids": [-1]}, r"prompt_token_ids must lie in \[0, 6144\)"),
    ({"prompt_token_ids": list(range(2, 130))}, "max_model_len"),
])
def test_bad_prompts_raise_value_error(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)


def test_max_tokens_beyond_max_model_len_stops_at_the_context(llm):
    """vLLM serves prompt + max_tokens > max_model_len and stops at the limit."""
    sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, min_tokens=40)
    out = llm.generate({"prompt_token_ids": list(range(2, 100))}, sp, use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (128 - 98, "length"), \
        "a request over the context must run to max_model_len and finish with 'length'"
    assert sp.max_tokens == 50, "the caller's SamplingParams must not be changed"
    assert_pool_full(llm)


def test_greedy_n_above_one_is_rejected():
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        SamplingParams(n=2, temperature=0)


def test_bad_request_in_a_batch_adds_nothing(llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([good, {"prompt_token_ids": [99999]}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests(), "a rejected batch left requests behind"
    assert_pool_full(llm)


def test_batch_the_engine_core_refuses_adds_nothing():
    # Shorter than max_model_len, too large for a 4-block pool: the processor refuses
    # the second request (it knows the pool from the core's handshake) before the
    # first is added, and the scheduler would refuse it too.
    small = make_llm(block_size=8, max_model_len=128, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="could never run"):
        small.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(3, 60))}],
                       SamplingParams(max_tokens=3), use_tqdm=False)
    assert not small.llm_engine.has_unfinished_requests(), "a refused batch left its first request behind"
    assert_pool_full(small)


def test_processed_request_is_added_as_it_is(llm):
    eng = llm.llm_engine
    req = eng.processor.process_inputs("p", "def f(x):", SamplingParams(max_tokens=500, temperature=0))
    assert req.prompt == "def f(x):" and req.sampling_params.max_tokens == 128 - len(req.prompt_token_ids), \
        "the processor returns the text, its tokens and final params (max_tokens capped to the context)"
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("other", req)
    with pytest.raises(ValueError, match="params must be None"):
        eng.add_request("p", req, SamplingParams(max_tokens=3))
    calls = []
    real = eng.processor.process_inputs
    eng.processor.process_inputs = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        eng.add_request("p", req)
    finally:
        del eng.processor.process_inputs
    assert not calls, "a processed request must not be validated (or tokenized) again"
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.prompt for o in outs] == ["def f(x):"] and outs[0].prompt_token_ids == req.prompt_token_ids, (
        f"a processed request lost its prompt text or tokens on the way through the engine: {[o.prompt for o in outs]}")
    assert_pool_full(llm)


def test_bad_request_mid_flight_does_not_disturb_others(llm):
    eng = llm.llm_engine
    p = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    eng.add_request("a", {"prompt_token_ids": p}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    eng.step()
    for bad in ({"prompt_token_ids": []}, {"prompt_token_ids": [7000]}):
        with pytest.raises(ValueError):
            eng.add_request("b", bad, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", {"prompt_token_ids": p}, SamplingParams(max_tokens=3))
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            final = o if o.finished else final
    assert final.request_id == "a", (
        f"the last finished request must be the good one, 'a', got {final.request_id!r}: a rejected 'b' or a "
        "duplicate 'a' reached the engine")
    assert final.outputs[0].token_ids == run_greedy(make_llm(), [p], 12)[0], \
        "a rejected request disturbed a request in flight"
    assert_pool_full(llm)


def test_sampling_params_list_length_must_match(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()], use_tqdm=False)


def test_unknown_engine_argument():
    with pytest.raises(ValueError, match="unknown engine argument"):
        make_llm(block_sise=16)


@pytest.mark.parametrize("kw, field", [(dict(block_size=12), "block_size"),
                                       (dict(dtype="int8"), "dtype"),
                                       (dict(attention_backend="flash"), "attention_backend")])
def test_bad_engine_config(kw, field):
    with pytest.raises(ValueError, match=field):
        make_llm(**kw)


def _bad_checkpoint(tmp_path, case: str) -> str:
    """A model folder wrong in one way: missing, without weights, of an unknown architecture,
    of an unknown model type."""
    from mini_vllm.course.tiny_models import model_path

    if case == "missing":
        return str(tmp_path / "nope")
    config = json.loads((model_path("tiny-py-target") / "config.json").read_text())
    if case == "architecture":
        config["architectures"] = ["FooForCausalLM"]
    if case == "model_type":
        config = {"model_type": "gpt2", "vocab_size": 10, "architectures": ["Qwen3ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if case != "weights":
        (tmp_path / "model.safetensors").write_bytes(b"")  # never opened: the config is refused first
    return str(tmp_path)


# vLLM 0.32 raises these in the calling process (`EngineArgs.create_engine_config`; the weights'
# in its worker, with this type and wording); so must the front end, before any core starts.
BAD_CHECKPOINTS = [
    ("missing", ValueError, r"Invalid repository ID or local directory specified: '.*nope'"),
    ("weights", RuntimeError, r"Cannot find any model weights with `.*`"),
    # every class the loader registers, listed as vLLM lists them
    ("architecture", ValueError, r"Model architectures \['FooForCausalLM'\] are not supported for now\. "
                                 r"Supported architectures: " + re.escape(str(sorted(
                                     cls.__name__ for cls in MODEL_REGISTRY.values())))),
    ("model_type", ValueError, r"model_type 'gpt2' is not supported"),
]


@pytest.mark.parametrize("case,error,match", BAD_CHECKPOINTS)
@pytest.mark.parametrize("multiprocess", [False, True])
def test_a_bad_checkpoint_is_refused_before_any_core_starts(monkeypatch, tmp_path, case, error, match, multiprocess):
    from mini_vllm.engine import llm_engine

    def no_core(*args, **kwargs):
        raise AssertionError(f"a core was started for a checkpoint the front end could refuse ({case})")

    monkeypatch.setattr(llm_engine, "SyncMPClient", no_core)
    monkeypatch.setattr(llm_engine, "InprocClient", no_core)
    with pytest.raises(error, match=match):
        LLM(_bad_checkpoint(tmp_path, case), multiprocess_mode=multiprocess)


@pytest.mark.parametrize("case,error,match", BAD_CHECKPOINTS[:2])
def test_the_async_engine_refuses_a_bad_checkpoint_before_its_core_starts(monkeypatch, tmp_path, case, error, match):
    from mini_vllm.engine import async_llm

    monkeypatch.setattr(async_llm, "AsyncMPClient", lambda *a, **k: pytest.fail("a core was started"))
    with pytest.raises(error, match=match):
        async_llm.AsyncLLM.from_engine_args(_bad_checkpoint(tmp_path, case))


def test_folder_without_tokenizer_uses_the_config_eos(tmp_path):
    """A bare checkpoint (no tokenizer files) must not get a placeholder tokenizer
    whose EOS id differs from config.json's."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=128, eos_token_id=42)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    llm = make_llm(str(tmp_path))
    assert llm.get_tokenizer() is None, (
        "a folder without tokenizer files got a placeholder tokenizer (whose EOS id can differ from config.json's)")
    assert llm.llm_engine.eos_token_id == 42, "EOS must come from config.json when there is no tokenizer"
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text", SamplingParams(max_tokens=2), use_tqdm=False)
