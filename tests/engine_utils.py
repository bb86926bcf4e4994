"""Helpers shared by the Chapter 5 engine tests: build a small engine, run
greedy workloads, and check that every KV block came back."""
from __future__ import annotations

import os

import torch

from mini_vllm import LLM, SamplingParams
from mini_vllm.course.tiny_models import model_path

SMALL_KV = 8 << 20  # 8 MiB: ~200 blocks of the tiny target in fp32, cheap to allocate
# `make gpu-check` runs the engine tests on CUDA with the Triton backend by setting
# these; unset, the engine runs on the CPU with its default backend.
DEVICE = os.environ.get("MINI_VLLM_TEST_DEVICE", "cpu")
ATTENTION_BACKEND = os.environ.get("MINI_VLLM_TEST_ATTENTION_BACKEND") or None


# vLLM's default for num_speculative_tokens_per_batch_size: k drafts at every batch size. The
# engine's own default measures a schedule at start-up (spec_decode/engine/auto_schedule.py), so a
# test that counts drafts or compares them with vLLM passes this to keep them independent of timing.
ALWAYS_DRAFT = {"num_speculative_tokens_per_batch_size": None}


def target_path() -> str:
    return str(model_path("tiny-py-target"))


def make_llm(path: str | None = None, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory_bytes", SMALL_KV)
    kw.setdefault("device", DEVICE)
    kw.setdefault("attention_backend", ATTENTION_BACKEND)
    return LLM(path or target_path(), **kw)


def make_llm_for(impl: str, path: str | None = None, **kw) -> LLM:
    """`make_llm`, with the Chapter 5 exercise's ModelRunner plugged in under --impl=exercise."""
    llm = make_llm(path, **kw)
    if impl == "exercise":
        from mini_vllm.exercise import plug_runner
        plug_runner(llm)
    return llm


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_greedy(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [greedy(m) for m in max_tokens], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def model_runner(llm: LLM):
    """The ModelRunner of an engine whose core runs in this process (multiprocess_mode=False)."""
    return llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner


def assert_pool_full(llm: LLM) -> None:
    # Utility calls: the same check whether the core runs here or in its own process.
    eng, call = llm.llm_engine, llm.llm_engine.engine_core.call_utility
    assert not call("has_unfinished_requests"), "requests left in the scheduler"
    free = call("num_free_blocks")
    assert free == eng.num_gpu_blocks, (
        f"KV blocks leaked: {eng.num_gpu_blocks - free} of {eng.num_gpu_blocks} "
        "still held after every request finished")
    assert call("num_free_cpu_blocks") == eng.num_cpu_blocks, \
        "CPU swap blocks leaked after every request finished"


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                            min_new_tokens=max_tokens, do_sample=False, top_k=None, top_p=None,
                            temperature=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
