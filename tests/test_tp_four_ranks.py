"""TP = 4 on the trained tiny target (gloo, four CPU processes on whatever cores
there are): 2 kv heads over 4 ranks, so each kv head is replicated on two
ranks; and the random tiny configs of tp_utils at TP = 4. Oracle: the TP = 1
engine. Four processes are the slow part, so the prompts are short.
"""
from __future__ import annotations

import operator

import pytest
import torch

from engine_utils import make_llm, run_greedy
from tp_utils import TP_CONFIGS, save_random_checkpoint, wait_no_tp_children


def _prompts(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (5, 23, 41)]


def test_tiny_target_tp4_replicates_kv_heads_and_matches_tp1():
    prompts = _prompts(6144, 4)
    one = make_llm(num_gpu_blocks_override=64)  # same pool: same block ids on both engines
    ref = run_greedy(one, prompts, 10)
    four = make_llm(tensor_parallel_size=4, num_gpu_blocks_override=64)
    try:
        ex = four.llm_engine.engine_core.engine_core.executor
        assert ex.collective_rpc(operator.attrgetter("tp_group.rank")) == [0, 1, 2, 3]
        assert ex.collective_rpc(operator.attrgetter("num_kv_heads")) == [1] * 4, \
            "2 kv heads over 4 ranks: each rank holds one (replicated) kv head"
        got = run_greedy(four, prompts, 10)
        caches = ex.collective_rpc(operator.attrgetter("cache_engine.gpu_cache"))
    finally:
        four.shutdown()
    assert got == ref, "TP = 4 (replicated kv heads) greedy tokens differ from TP = 1"
    full = one.llm_engine.engine_core.engine_core.executor.collective_rpc(operator.attrgetter("cache_engine.gpu_cache"))[0]
    for layer, (k, v) in enumerate(full):
        for r, c in enumerate(caches):
            kv = r // 2  # ranks 0, 1 read kv head 0; ranks 2, 3 read kv head 1
            torch.testing.assert_close(c[layer][0], k[:, :, kv:kv + 1], atol=1e-4, rtol=1e-4,
                                       msg=f"layer {layer} rank {r}: keys are not kv head {kv}'s")
            torch.testing.assert_close(c[layer][1], v[:, :, kv:kv + 1], atol=1e-4, rtol=1e-4,
                                       msg=f"layer {layer} rank {r}: values are not kv head {kv}'s")
    assert not wait_no_tp_children(), "worker process left after shutdown"


@pytest.mark.parametrize("name", list(TP_CONFIGS))
def test_random_models_tp4_greedy_identical_to_tp1(tmp_path, name):
    """Random Llama (2 kv heads), Qwen2 (1 kv head) and Qwen3 (4 kv heads, biases)
    over 4 ranks: kv heads replicated 2x, 4x, or split one per rank."""
    path = str(save_random_checkpoint(name, tmp_path, 9000 + list(TP_CONFIGS).index(name)))
    prompts = _prompts(97, 5)
    kw = dict(block_size=8, max_num_batched_tokens=32)
    ref = run_greedy(make_llm(path, **kw), prompts, 8)
    four = make_llm(path, tensor_parallel_size=4, **kw)
    try:
        got = run_greedy(four, prompts, 8)
    finally:
        four.shutdown()
    assert got == ref, f"{name}: TP = 4 greedy tokens differ from TP = 1"
    assert not wait_no_tp_children(), "worker process left after shutdown"
