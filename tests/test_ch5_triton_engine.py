"""The `triton` attention backend serving whole models through the engine.

On a machine without CUDA the kernels run in Triton's interpreter
(`tests/conftest.py` sets TRITON_INTERPRET=1 before any kernel is defined), so
this is the Triton path of a learner's GPU run, minus the compiler: the
runner's metadata, the cache writes and the varlen kernel across a whole
workload. With CUDA the same tests run the compiled kernels on the GPU.

Oracles: Hugging Face transformers (greedy `generate` of each prompt alone,
and the log-softmax of one forward pass over prompt + output) and the same
engine with the `torch` backend. The workload forces chunked prefill (a
prompt longer than the token budget) and prefix-cache hits (a repeated
prompt and one that shares its first blocks). `logprobs=vocab_size` returns
the whole distribution at every generated position, so the comparison covers
every logit, not only the chosen token.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from engine_utils import assert_pool_full, hf_greedy, make_llm
from hf_configs import tiny_config
from mini_vllm import SamplingParams

ATOL = 1e-4
MAX_TOKENS = 8
BLOCK_SIZE = 8
TOKEN_BUDGET = 16  # max_num_batched_tokens: the 37-token prompt needs three chunks
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# 2 layers, hidden 64, head_dim 16, GQA 2. No EOS token: HF's `min_new_tokens`
# would mask it out of the oracle's logits while `ignore_eos` keeps it in ours.
CONFIGS = {
    "qwen3": lambda: tiny_config(Qwen3Config, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 eos_token_id=None),
    "llama": lambda: tiny_config(LlamaConfig, num_attention_heads=4, num_key_value_heads=2, eos_token_id=None),
}


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    long = torch.randint(2, vocab, (37,), generator=g).tolist()
    tail = torch.randint(2, vocab, (5,), generator=g).tolist()
    short = torch.randint(2, vocab, (3,), generator=g).tolist()
    # the long prompt, a short one, one token, one sharing the long prompt's first
    # three blocks, and the long prompt again (a whole-prompt prefix hit)
    return [long, short, [int(long[0])], long[:3 * BLOCK_SIZE] + tail, list(long)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    """(name, folder, HF model in fp32) for a random checkpoint written by save_pretrained."""
    torch.manual_seed(2024)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():  # norm weights start at 1; random ones make their use visible
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, str(path), hf.eval()


def _serve(path: str, backend: str, prompts, vocab: int):
    """Greedy tokens and [MAX_TOKENS, vocab] logprobs per prompt, plus the engine."""
    assert len(prompts[0]) > TOKEN_BUDGET, "the workload must force chunked prefill"
    llm = make_llm(path, attention_backend=backend, device=DEVICE, block_size=BLOCK_SIZE,
                   max_num_batched_tokens=TOKEN_BUDGET, enable_chunked_prefill=True,
                   enable_prefix_caching=True, max_model_len=128)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens, logprobs = [], []
    for o in outs:
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        logprobs.append(torch.tensor([[step[t].logprob for t in range(vocab)] for step in c.logprobs]))
    return tokens, logprobs, llm


def test_triton_backend_matches_torch_backend_and_hf(model):
    name, path, hf = model
    vocab = hf.config.vocab_size
    prompts = _prompts(vocab)
    got_tokens, got_lp, llm = _serve(path, "triton", prompts, vocab)
    backend = llm.llm_engine.engine_core.engine_core.executor.collective_rpc(lambda worker: worker.attention_backend)[0]
    assert backend == "triton", "the engine did not run the backend it was asked for"
    hits = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.prefix_cache_stats.hits
    assert hits > 0, "the workload must hit the prefix cache (repeated and shared prompts)"
    assert_pool_full(llm)

    ref_tokens, ref_lp, _ = _serve(path, "torch", prompts, vocab)
    for i, p in enumerate(prompts):
        assert got_tokens[i] == ref_tokens[i], (
            f"{name}: prompt {i} (len {len(p)}): triton backend greedy tokens differ from the torch "
            f"backend's\ntriton {got_tokens[i]}\ntorch  {ref_tokens[i]}")
        err = (got_lp[i] - ref_lp[i]).abs().max().item()
        assert err <= ATOL, (f"{name}: prompt {i}: triton logprobs differ from the torch backend's by "
                             f"{err:.2e}: the kernel reads a wrong cache slot, mask or GQA head")

    for i, p in enumerate(prompts):
        want = hf_greedy(hf, p, MAX_TOKENS)
        assert got_tokens[i] == want, (f"{name}: prompt {i} (len {len(p)}): triton engine greedy tokens "
                                       f"differ from HF generate\nengine {got_tokens[i]}\nhf     {want}")
        with torch.no_grad():
            logits = hf(torch.tensor([p + want])).logits[0].float()
        ref = logits[len(p) - 1:len(p) - 1 + MAX_TOKENS].log_softmax(-1)
        err = (got_lp[i] - ref).abs().max().item()
        assert err <= ATOL, (f"{name}: prompt {i} (len {len(p)}): triton engine logprobs differ from HF's "
                             f"log-softmax by {err:.2e}: a chunk, a prefix hit or a decode misreads the cache")
