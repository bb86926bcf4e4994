"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against HF's log-softmax.

Oracle: one Hugging Face forward pass over the prompt in fp32; row p of its
log-softmax scores prompt token p + 1. The engine computes the same numbers
from the logits of every prefill row, chunk by chunk: the token budget here
(16) cuts every prompt into several chunks, and two prompts share each step.
"""
import pytest
import torch

from engine_utils import assert_pool_full, make_llm
from mini_vllm import SamplingParams
from mini_vllm.course.tiny_models import load_tiny_model, load_tiny_tokenizer

CODE = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
        "import os\nimport sys\n\nfor name in sorted(os.listdir('.')):\n    if name.endswith('.py'):\n"
        "        print(name, os.path.getsize(name))\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n"]


@pytest.fixture(scope="module")
def hf():
    return load_tiny_model("tiny-py-target", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts():
    tok = load_tiny_tokenizer()
    return [tok(p)["input_ids"] for p in CODE]


def _hf_logprobs(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def _check(plp, prompt, ref, k, who):
    assert len(plp) == len(prompt) and plp[0] is None, \
        f"{who}: prompt_logprobs must have one entry per prompt token, None first"
    for p in range(1, len(prompt)):
        d, row = plp[p], ref[p - 1]
        tok = prompt[p]
        assert tok in d, f"{who}: position {p} lacks the prompt token itself"
        assert d[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4), \
            f"{who}: position {p} scores the wrong token or the wrong row (off by one?)"
        assert d[tok].rank == int((row >= row[tok]).sum()), f"{who}: rank of the prompt token at {p}"
        top_v, top_i = row.topk(k)
        for r, (i, v) in enumerate(zip(top_i.tolist(), top_v.tolist()), start=1):
            assert i in d and d[i].logprob == pytest.approx(v, abs=1e-4), f"{who}: top-{r} at {p}"
        assert len(d) <= k + 1, (
            f"{who}: position {p} holds {len(d)} entries, more than the top-{k} plus the prompt token")


def test_prompt_logprobs_match_hf_with_small_chunks(hf, prompts):
    """Three prompts in one batch, chunked by a 16-token budget: one with k=3,
    one without prompt logprobs, one with k=0 (the prompt token alone)."""
    llm = make_llm(block_size=8, max_num_batched_tokens=16, max_model_len=256)
    assert all(len(p) > 32 for p in prompts[:2]), "prompts must span several chunks"
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3),
              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _check(outs[0].prompt_logprobs, prompts[0], _hf_logprobs(hf, prompts[0]), 3, "k=3")
    assert outs[1].prompt_logprobs is None, "a request without prompt_logprobs got some"
    plp = outs[2].prompt_logprobs
    _check(plp, prompts[2], _hf_logprobs(hf, prompts[2]), 0, "k=0")
    assert all(len(d) == 1 for d in plp[1:]), "k=0 returns the prompt token only"
    alone = make_llm(block_size=8).generate({"prompt_token_ids": prompts[0]}, params[0], use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids, \
        "prompt logprobs changed the sampled tokens"
    assert_pool_full(llm)


def test_prefix_cache_hit_is_skipped_for_prompt_logprobs(hf, prompts):
    """vLLM v1 (`SamplingParams.skip_reading_prefix_cache`): cached blocks have no
    logits, so a request with prompt_logprobs computes its whole prompt; the
    blocks it writes still serve the next request."""
    llm = make_llm(block_size=8, max_num_batched_tokens=16)
    kv = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    p = {"prompt_token_ids": prompts[1]}
    llm.generate(p, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    hits = kv.prefix_cache_stats.hits
    out = llm.generate(p, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert kv.prefix_cache_stats.hits == hits, "a prompt-logprobs request read the prefix cache"
    _check(out.prompt_logprobs, prompts[1], _hf_logprobs(hf, prompts[1]), 2, "after a cached run")
    llm.generate(p, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert kv.prefix_cache_stats.hits > hits, "the next plain request must still hit the cache"
    with pytest.raises(ValueError, match="skip_reading_prefix_cache"):
        SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)


def test_streamed_delta_carries_prompt_logprobs_once(prompts):
    llm = make_llm(block_size=8, max_num_batched_tokens=16)
    eng = llm.llm_engine
    eng.add_request("s", {"prompt_token_ids": prompts[0]},
                    SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=1),
                    output_kind="delta")
    seen = []
    while eng.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in eng.step()]
    with_lp = [x for x in seen if x is not None]
    assert len(seen) >= 5 and len(with_lp) == 1, \
        f"delta outputs must carry the prompt logprobs exactly once, got {len(with_lp)} of {len(seen)}"
    assert len(with_lp[0]) == len(prompts[0]), (
        "the streamed prompt logprobs must cover the whole prompt in one delta (chunks sent separately?): "
        f"{len(with_lp[0])} of {len(prompts[0])} positions")


def test_max_logprobs_caps_both_kinds():
    llm = make_llm(max_logprobs=5)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{name} must be in \[0, 5\] \(max_logprobs\)"):
            llm.generate("x = 1", SamplingParams(max_tokens=2, **{name: 6}), use_tqdm=False)
    out = llm.generate("x = 1", SamplingParams(max_tokens=2, logprobs=5, prompt_logprobs=5), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs) == 2, (
        "logprobs=5 at max_logprobs=5 must be allowed and give one entry per output token, got "
        f"{len(out.outputs[0].logprobs)}")
