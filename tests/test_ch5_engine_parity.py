"""The engine against Hugging Face transformers: greedy tokens and logprobs.

The engine's own models run over the paged cache with continuous batching;
`transformers` runs each prompt alone with a contiguous cache. Same tokens
means the whole stack (scheduler, runner inputs, slot mapping, attention
backend, model, sampler) agrees with the oracle. Under --impl=exercise the
engines run the Chapter 5 exercise's ModelRunner (`plug_runner`).
"""
import pytest
import torch

from engine_utils import assert_pool_full, hf_greedy, make_llm, make_llm_for, run_greedy, target_path
from hf_configs import RANDOM_CONFIGS
from mini_vllm import SamplingParams
from mini_vllm.course.tiny_models import load_tiny_model, load_tiny_tokenizer

PROMPTS = [
    "def fib(n):",
    "import os\nimport sys\n",
    "class Foo(object):\n    def __init__(self",
    "x = [i for i in range(10)]\n" * 6,
    "#",
    "    return self._data[key]\n\n    def __setitem__(self, key, value):\n",
    "try:\n    import threading\nexcept ImportError:\n",
    "def main(argv=None):\n    parser = argparse.ArgumentParser(description=",
    "for k, v in sorted(d.items()):\n        print(k, v)\n" * 3,
]


@pytest.fixture(scope="module")
def hf():
    return load_tiny_model("tiny-py-target", dtype=torch.float32)


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


# "cpu" (the compiled kernel, the CPU default that every other engine test runs)
# and "torch" (the readable path); "triton" has its own engine tests.
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_batch_matches_hf_generate(hf, tok, backend, impl):
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) >= 8, "prompts must have different lengths"
    lens = [20, 12, 30, 8, 25, 16, 20, 10, 14]
    llm = make_llm_for(impl, block_size=16, attention_backend=backend)
    assert llm.llm_engine.engine_core.engine_core.executor.collective_rpc(lambda w: w.attention_backend)[0] == backend, "backend not the one asked for"
    got = run_greedy(llm, prompts, lens)
    for i, (p, n) in enumerate(zip(prompts, lens)):
        want = hf_greedy(hf, p, n)
        assert got[i] == want, (f"{backend} backend, prompt {i} ({PROMPTS[i][:20]!r}): engine greedy tokens "
                                f"differ from HF generate(do_sample=False)\nengine {got[i]}\nhf     {want}")
    assert_pool_full(llm)


def test_logprobs_match_hf_log_softmax(hf, tok, impl):
    """Greedy logprobs (temperature 0 = raw distribution) equal HF's log-softmax."""
    prompt = tok(PROMPTS[2])["input_ids"]
    llm = make_llm_for(impl, block_size=8)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    seq = prompt + out.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    total = 0.0
    for j, (tok_id, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert tok_id in lp and lp[tok_id].rank == 1, "greedy token must be in logprobs with rank 1"
        assert abs(lp[tok_id].logprob - float(row[tok_id])) < 1e-4, "sampled logprob differs from HF"
        top = row.topk(3)
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert t in lp and abs(lp[t].logprob - v) < 1e-4 and lp[t].rank == r, \
                f"top-{r} logprob entry differs from HF's log-softmax at step {j}"
        total += float(row[tok_id])
    assert abs(out.cumulative_logprob - total) < 1e-3, "cumulative_logprob is not the sum of logprobs"


def test_text_prompt_and_detokenized_text_match_tokenizer(tok):
    llm = make_llm()
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == tok(PROMPTS[0])["input_ids"], (
        "a text prompt was tokenized differently from the model's tokenizer (special tokens added or dropped?)")
    c = out.outputs[0]
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True), \
        "incremental detokenization differs from decoding all output tokens at once"


@pytest.mark.parametrize("name", ["llama-mha-untied", "llama3-rope-gqa2-tied", "qwen2-gqa4-tied",
                                  "qwen3-gqa2-untied-bias", "tiny-py-draft"])
def test_greedy_matches_hf_on_every_architecture(name, tmp_path_factory, impl):
    """Random Llama / Qwen2 / Qwen3 checkpoints (GQA 1/2/4, tied and untied,
    llama3 rope scaling) and the tiny draft: 8 prompts of different lengths together."""
    from transformers import AutoModelForCausalLM

    from mini_vllm.course.tiny_models import model_path

    if name in RANDOM_CONFIGS:
        torch.manual_seed(7)
        hf = AutoModelForCausalLM.from_config(RANDOM_CONFIGS[name]()).eval()
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
    else:
        path = model_path(name)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(3)
    lens = [1, 3, 7, 12, 17, 24, 33, 41]
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]
    llm = make_llm_for(impl, str(path), block_size=8, max_model_len=128)
    got = run_greedy(llm, prompts, 10)
    for p, out in zip(prompts, got):
        assert out == hf_greedy(hf, p, 10), f"{name}: greedy tokens differ from HF for a {len(p)}-token prompt"
    assert_pool_full(llm)
