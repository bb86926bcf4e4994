"""Tensor parallelism across architectures (gloo, CPU processes).

Random tiny Llama / Qwen2 / Qwen3 checkpoints at TP = 2: vocab 97, so the
vocab-parallel tables are padded; Qwen2 has one kv head, replicated on both
ranks; Qwen3 has q/k/v/o biases and untied embeddings. TP = 4 is in
test_tp_four_ranks.py. Oracles: the TP = 1 engine and Hugging Face `generate`.
"""
from __future__ import annotations

import operator

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_utils import hf_greedy, make_llm, run_greedy
from tp_utils import TP_CONFIGS, save_random_checkpoint, wait_no_tp_children


def _prompts(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (5, 23, 41)]


@pytest.mark.parametrize("name", list(TP_CONFIGS))
def test_random_models_tp2_greedy_identical_to_tp1_and_hf(tmp_path, name):
    path = str(save_random_checkpoint(name, tmp_path, 7000 + list(TP_CONFIGS).index(name)))
    prompts = _prompts(97, 3)
    kw = dict(block_size=8, max_num_batched_tokens=32)  # prompts of 41 tokens prefill in chunks
    ref = run_greedy(make_llm(path, **kw), prompts, 12)
    two = make_llm(path, tensor_parallel_size=2, **kw)
    try:
        kv = two.llm_engine.engine_core.engine_core.executor.collective_rpc(operator.attrgetter("num_kv_heads"))
        heads = TP_CONFIGS[name]().num_key_value_heads
        assert kv == [max(1, heads // 2)] * 2, "kv heads per rank: split, or 1 when replicated"
        got = run_greedy(two, prompts, 12)
    finally:
        two.shutdown()
    assert got == ref, f"{name}: TP = 2 greedy tokens differ from TP = 1"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got[1] == hf_greedy(hf, prompts[1], 12), f"{name}: TP = 2 greedy differs from HF generate"
    assert not wait_no_tp_children(), "worker process left after shutdown"
