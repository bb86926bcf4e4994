"""Greedy output, and a seeded request's output, must not depend on how the
engine schedules the work.

Oracle: every request run alone (max_num_seqs=1, a large budget, no prefix
cache). Variations, drawn by hypothesis: batching, chunked prefill (a small
token budget forces chunks), prefix caching (prompts share prefixes and some
repeat, so later requests hit blocks that earlier ones, even in the same step,
wrote), preemption forced by a tiny KV cache under recompute and under swap,
and block sizes 8/16/32. After every run the KV pool must be full again.
Under --impl=exercise the engine under test runs the Chapter 5 exercise's
ModelRunner (`plug_runner`); the oracle stays the reference engine.
"""
import functools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_utils import assert_pool_full, make_llm, make_llm_for, run_greedy
from mini_vllm import SamplingParams

VOCAB = 6144


@functools.lru_cache(maxsize=None)
def _alone(prompt: tuple, max_tokens: int) -> tuple:
    llm = _alone_llm()
    return tuple(run_greedy(llm, [list(prompt)], max_tokens)[0])


@functools.lru_cache(maxsize=1)
def _alone_llm():
    return make_llm(max_num_seqs=1, enable_prefix_caching=False, block_size=16)


@st.composite
def workloads(draw):
    prefix = draw(st.lists(st.integers(2, VOCAB - 1), min_size=0, max_size=40))
    n = draw(st.integers(2, 5))
    prompts = []
    for _ in range(n):
        if prompts and draw(st.booleans()) and draw(st.booleans()):
            prompts.append(list(draw(st.sampled_from(prompts))))  # an exact repeat
            continue
        tail = draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=30))
        prompts.append(prefix + tail if draw(st.booleans()) else tail)
    max_tokens = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    return prompts, max_tokens


ENGINE_VARIANTS = st.fixed_dictionaries({
    "block_size": st.sampled_from([8, 16, 32]),
    "enable_prefix_caching": st.booleans(),
    "chunk": st.sampled_from([None, 8, 24]),
    "tiny_kv": st.booleans(),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
})


def _engine(v, prompts, max_tokens, impl):
    kw = dict(block_size=v["block_size"], enable_prefix_caching=v["enable_prefix_caching"],
              max_model_len=128, preemption_mode=v["preemption_mode"])
    if v["chunk"]:
        kw["max_num_batched_tokens"] = v["chunk"]
    if v["tiny_kv"]:
        # Room for the longest request and a little more: the others must be preempted.
        need = max(-(-(len(p) + m) // v["block_size"]) for p, m in zip(prompts, max_tokens))
        kw["num_gpu_blocks_override"] = need + 1
        if v["preemption_mode"] == "swap":
            kw["num_cpu_blocks"] = 64
    return make_llm_for(impl, **kw)


@given(work=workloads(), variant=ENGINE_VARIANTS)
def test_greedy_tokens_invariant_to_scheduling(work, variant, impl):
    prompts, max_tokens = work
    llm = _engine(variant, prompts, max_tokens, impl)
    got = run_greedy(llm, prompts, max_tokens)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        want = list(_alone(tuple(p), m))
        assert got[i] == want, (f"request {i} (prompt len {len(p)}) under {variant}: tokens differ "
                                f"from the request run alone\n got  {got[i]}\n want {want}")
    assert_pool_full(llm)


def _num_preemptions(llm) -> int:
    return llm.llm_engine.engine_core.call_utility("make_stats")["num_preemptions"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_really_happens_and_changes_nothing(mode, impl):
    """Guard against a vacuous invariance test: the tiny cache must preempt."""
    _check_preemption(mode, impl, multiprocess_mode=False)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_changes_nothing_with_the_core_in_its_own_process(mode):
    """The same with the core in its own process, which steps on while the front end
    detokenizes (reference only: the exercise's runner plugs into an in-process core)."""
    _check_preemption(mode, "reference", multiprocess_mode=True)


def _check_preemption(mode, impl, multiprocess_mode):
    prompts = [[5 + i] * 20 + list(range(100 + 10 * i, 110 + 10 * i)) for i in range(4)]
    llm = make_llm_for(impl, block_size=8, max_model_len=128, num_gpu_blocks_override=9,
                       preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0,
                       multiprocess_mode=multiprocess_mode)
    got = run_greedy(llm, prompts, 30)
    assert _num_preemptions(llm) > 0, "the tiny KV cache never preempted"
    for p, g in zip(prompts, got):
        assert g == list(_alone(tuple(p), 30)), f"{mode} preemption changed a request's tokens"
    assert_pool_full(llm)
    llm.shutdown()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_invariant_under_preemption(mode, impl):
    """A seeded request's generator lives as long as the request: a preempted
    request, recomputed or swapped back in, continues its draws where it
    stopped, so its tokens equal those of the same requests in a cache that
    never preempts."""
    _check_seeded_preemption(mode, impl, multiprocess_mode=False)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_invariant_with_the_core_in_its_own_process(mode):
    _check_seeded_preemption(mode, "reference", multiprocess_mode=True)


def _check_seeded_preemption(mode, impl, multiprocess_mode):
    prompts = [[5 + i] * 20 + list(range(100 + 10 * i, 110 + 10 * i)) for i in range(4)]
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]

    def run(impl="reference", **kw):
        llm = make_llm_for(impl, block_size=8, max_model_len=128, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outs]

    _, want = run()
    llm, got = run(impl, num_gpu_blocks_override=9, preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0,
                   multiprocess_mode=multiprocess_mode)
    assert _num_preemptions(llm) > 0, "the tiny KV cache never preempted"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (f"seeded request {i} changed under {mode} preemption: its generator was reset or "
                        f"re-created when it was preempted instead of continuing its draws\n got  {g}\n want {w}")
    assert_pool_full(llm)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_same_step_prefix_hit_reads_kv_written_in_that_step(backend, impl):
    """Two identical 40-token prompts admitted in one step: the second hits the
    first's blocks, which this very forward pass writes. Both CPU backends: the
    oracle (`_alone`) runs the default, "cpu"."""
    p = list(range(300, 340))
    llm = make_llm_for(impl, block_size=8, max_model_len=128, attention_backend=backend)
    got = run_greedy(llm, [p, p, p[:33]], [6, 6, 6])
    stats = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.prefix_cache_stats
    assert stats.hits > 0, "the repeated prompt did not hit the prefix cache"
    assert got[0] == got[1] == list(_alone(tuple(p), 6)), "a same-step prefix hit read unwritten KV"
    assert got[2] == list(_alone(tuple(p[:33]), 6)), (
        "a same-step prefix hit for the 33-token prefix (4 full blocks hit, 1 token computed) read unwritten KV or "
        "the wrong blocks")
    assert_pool_full(llm)
