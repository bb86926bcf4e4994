"""The engine with tensor_parallel_size = 2 (gloo, two processes) against TP = 1
and against Hugging Face, on the trained tiny target.

The pair of engines shares one workload history (same requests, same order),
with a KV pool small enough to preempt, chunked prefill and prefix caching
on, so the scheduler makes the same decisions for both and block ids match:
greedy tokens must be identical, each rank's KV cache must be its kv heads'
slice of the TP = 1 cache after every step, and the logprobs must match the
oracle's log-softmax.
"""
from __future__ import annotations

import operator

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_utils import make_llm, run_greedy, target_path
from mini_vllm import SamplingParams
from tp_utils import wait_no_tp_children

ENGINE = dict(block_size=16, num_gpu_blocks_override=16, max_num_batched_tokens=48,
              enable_chunked_prefill=True, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def engines():
    one = make_llm(**ENGINE)
    two = make_llm(tensor_parallel_size=2, **ENGINE)
    yield one, two
    two.shutdown()
    assert not wait_no_tp_children(), "a worker process outlived LLM.shutdown()"


def _prompts(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 6000, (32,), generator=g).tolist()  # two full blocks: prefix hits
    return [shared + torch.randint(3, 6000, (int(l),), generator=g).tolist()
            for l in torch.randint(10, 40, (n,), generator=g)]


def test_greedy_tokens_identical_with_chunking_prefix_hits_and_preemption(engines):
    one, two = engines
    prompts = _prompts(0, 6)
    ref = run_greedy(one, prompts, 48)
    got = run_greedy(two, prompts, 48)
    s1, s2 = (llm.llm_engine.engine_core.call_utility("make_stats") for llm in engines)
    assert s1["num_preemptions"] > 0 and s1["prefix_cache_hits"] > 0, \
        "workload too small: it must preempt and hit the prefix cache to test those paths"
    assert (s2["num_preemptions"], s2["prefix_cache_hits"]) == (s1["num_preemptions"], s1["prefix_cache_hits"]), \
        "TP = 2 scheduled differently from TP = 1 (the scheduler must not depend on the ranks)"
    assert got == ref, "TP = 2 greedy tokens differ from TP = 1: a shard, a collective or the " \
                       "logits gather is wrong"


def test_each_rank_holds_its_kv_heads_slice_after_every_step(engines):
    one, two = engines
    ex1, ex2 = (llm.llm_engine.engine_core.engine_core.executor for llm in engines)
    assert ex2.collective_rpc(operator.attrgetter("tp_group.rank")) == [0, 1]
    (nkv,) = ex1.collective_rpc(operator.attrgetter("num_kv_heads"))
    assert ex2.collective_rpc(operator.attrgetter("num_kv_heads")) == [nkv // 2] * 2, \
        "each rank must allocate the KV cache of its own kv heads only"
    for i, p in enumerate(_prompts(1, 3)):
        for llm in engines:
            llm.llm_engine.add_request(f"kv{i}", {"prompt_token_ids": p},
                                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    steps = 0
    while one.llm_engine.has_unfinished_requests():
        out1, out2 = one.llm_engine.step(), two.llm_engine.step()
        assert [(o.request_id, o.outputs[0].token_ids) for o in out1] == \
            [(o.request_id, o.outputs[0].token_ids) for o in out2]
        steps += 1
        if steps % 3:
            continue  # every third step: the caches are the expensive part to fetch
        (full,) = ex1.collective_rpc(operator.attrgetter("cache_engine.gpu_cache"))
        ranks = ex2.collective_rpc(operator.attrgetter("cache_engine.gpu_cache"))
        for layer, (k, v) in enumerate(full):
            for r, caches in enumerate(ranks):
                h = nkv // 2
                kr, vr = caches[layer]
                assert kr.shape == (k.shape[0], k.shape[1], h, k.shape[3]), \
                    "block count and block size must match TP = 1; heads are split"
                torch.testing.assert_close(kr, k[:, :, r * h:(r + 1) * h], atol=1e-4, rtol=1e-4,
                                           msg=f"step {steps} layer {layer} rank {r}: keys are not "
                                               "this rank's heads' slice of the TP = 1 cache")
                torch.testing.assert_close(vr, v[:, :, r * h:(r + 1) * h], atol=1e-4, rtol=1e-4,
                                           msg=f"step {steps} layer {layer} rank {r}: values")
    assert steps >= 3
    assert not two.llm_engine.has_unfinished_requests()


def test_logprobs_match_hf_log_softmax(engines):
    _, two = engines
    prompt = _prompts(2, 1)[0]
    out = two.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=4),
                       use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(target_path(), dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        ref = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:].float(), -1)
    for t, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok == int(ref[t].argmax()), f"token {t}: greedy token is not HF's argmax"
        top = ref[t].topk(4)
        for tid, val in zip(top.indices.tolist(), top.values.tolist()):
            assert tid in lps, f"token {t}: HF top-4 id {tid} missing from the TP = 2 logprobs"
            assert abs(lps[tid].logprob - val) < 1e-4, \
                f"token {t}, id {tid}: logprob {lps[tid].logprob} vs HF {val}"
