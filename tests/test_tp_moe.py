"""Expert parallelism and the column split of a mixture of experts (gloo, CPU processes).

A random Qwen3-MoE checkpoint (8 experts top-2, one dense layer) at
tensor_parallel_size 2: with enable_expert_parallel each rank holds 4 whole
experts, without it every expert's half of the columns. Oracles: the TP = 1
engine and transformers' `generate`. The ranks' arithmetic is checked without
processes in test_ch5_moe_layer.py; here the all-reduce and the engine run.
"""
from __future__ import annotations

import operator

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_utils import hf_greedy, make_llm, run_greedy
from moe_utils import held_experts, save_random_moe
from tp_utils import wait_no_tp_children


@pytest.mark.parametrize("ep", [True, False], ids=["expert-parallel", "column-split"])
def test_moe_tp2_greedy_identical_to_tp1_and_hf(tmp_path, ep):
    path = str(save_random_moe("e8-k2-step2", tmp_path, 7300))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 97, (int(n),), generator=g).tolist() for n in (5, 23, 41)]
    kw = dict(block_size=8, max_num_batched_tokens=32)
    ref = run_greedy(make_llm(path, **kw), prompts, 10)
    two = make_llm(path, tensor_parallel_size=2, enable_expert_parallel=ep, **kw)
    try:
        held = two.llm_engine.engine_core.engine_core.executor.collective_rpc(held_experts)
        want = [[(0, 4, 32)] * 2, [(4, 4, 32)] * 2] if ep else [[(0, 8, 16)] * 2] * 2
        assert held == want, f"(expert offset, local experts, columns) per rank and sparse layer: {held}"
        got = run_greedy(two, prompts, 10)
    finally:
        two.shutdown()
    mode = "expert parallel" if ep else "column split"
    assert got == ref, f"TP = 2 ({mode}) greedy tokens differ from TP = 1 on Qwen3-MoE"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got[2] == hf_greedy(hf, prompts[2], 10), f"TP = 2 ({mode}) greedy differs from transformers' generate"
    assert not wait_no_tp_children(), "worker process left after shutdown"


def test_expert_parallel_size_must_divide_num_experts(tmp_path):
    path = str(save_random_moe("e8-k2-norm", tmp_path, 7301, num_attention_heads=6, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"must divide num_experts \(8\) with enable_expert_parallel"):
        make_llm(path, tensor_parallel_size=3, enable_expert_parallel=True)
    assert not wait_no_tp_children(), "no worker process may start for a size the model cannot split"
