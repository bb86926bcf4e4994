"""Every size `make gpu-check` uses, for the real run on CUDA and for `--small`.

No vLLM counterpart file. The full plan is sized to finish in about 13
minutes on one H100 (each section's share is in its budget); `--small` runs
the same code on shapes the CPU and Triton's interpreter finish in seconds,
so `make test` can check the script end to end and the report's shape.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    device: str
    small: bool
    # nano-vllm's bench.py: 256 sequences, random token ids in [0, 10000],
    # prompt lengths 100-1024, output lengths 100-1024, ignore_eos.
    num_requests: int = 256
    prompt_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    max_token_id: int = 10000
    # the engine under test
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    kv_cache_memory_bytes: int | None = None  # None on CUDA: gpu_memory_utilization sizes it
    gpu_memory_utilization: float = 0.9
    # HF baselines: static batches, each size for about hf_budget_s (whole batches, at least one)
    hf_batch_sizes: tuple[int, ...] = (32, 128)
    hf_budget_s: float = 45.0
    hf_continuous_budget_s: float = 120.0
    # greedy check: the first requests, exact tokens over a prefix of each
    greedy_requests: int = 4
    greedy_exact_tokens: int = 64
    # roofline: profiled steps per phase window (prefill-carrying, pure decode)
    roofline_profile_steps: int = 4
    # decode attention bandwidth: (query heads, KV heads, head_dim), batch sizes x context lengths
    attn_heads: tuple[int, int, int] = (16, 8, 128)
    attn_batches: tuple[int, ...] = (1, 8, 64, 256)
    attn_contexts: tuple[int, ...] = (512, 2048, 8192)
    attn_goal_shape: tuple[int, int] = (64, 2048)
    attn_iters: int = 20
    # fused MoE: (hidden, expert intermediate, experts, top-k) = Qwen3-30B-A3B's, batch sizes, the goal's batch
    moe_shape: tuple[int, int, int, int] = (2048, 768, 128, 8)
    moe_batches: tuple[int, ...] = (1, 64, 256)
    moe_goal_batch: int = 256
    moe_iters: int = 10
    # FP8 W8A8 linears: (K, N) of Qwen3-0.6B's qkv, o, gate_up and down projections, batch sizes
    fp8_shapes: tuple[tuple[int, int], ...] = ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024))
    fp8_batches: tuple[int, ...] = (1, 64, 2048)
    fp8_iters: int = 20
    # step profile: decode steps at these batch sizes, prompts of profile_prompt_len
    profile_batches: tuple[int, ...] = (1, 8, 64, 256)
    profile_steps: int = 5
    profile_prompt_len: int = 512  # the batch-1 goal is stated at 512 tokens of context
    # eager vs CUDA graph modes: each engine's KV cache (small: quick start-up)
    graph_kv_bytes: int = 4 << 30
    # the pytest subset
    tests_timeout_s: float = 270.0
    # stop starting sections after this many seconds (the report is still written)
    deadline_s: float = 14 * 60.0


def make_plan(device: str, small: bool, budget_s: float | None = None) -> Plan:
    """The full plan, `--small`'s, or (`budget_s`) the full shapes fitted into a
    device lease of that many seconds: one HF static batch of 128 (the largest
    that fits HF's growing cache beside the engine's leftovers; the 5x goal needs
    a baseline), no HF continuous batching, and the pytest subset last with
    whatever time is left."""
    if not small and budget_s is not None:
        return Plan(device=device, small=False, hf_batch_sizes=(128,), hf_budget_s=0.0, hf_continuous_budget_s=0.0,
                    attn_iters=10, profile_batches=(1, 8, 64), profile_steps=4,
                    tests_timeout_s=max(30.0, budget_s - 20.0), deadline_s=budget_s - 30.0)
    if not small:
        return Plan(device=device, small=False)
    return Plan(device=device, small=True, num_requests=4, prompt_len=(8, 24), output_len=(2, 8),
                max_token_id=511, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                kv_cache_memory_bytes=16 << 20, graph_kv_bytes=16 << 20, hf_batch_sizes=(2, 4), hf_budget_s=30.0,
                hf_continuous_budget_s=30.0, greedy_requests=2, greedy_exact_tokens=4, attn_heads=(4, 2, 16),
                attn_batches=(1, 2), attn_contexts=(16, 32), attn_goal_shape=(2, 32), attn_iters=1,
                moe_shape=(32, 16, 8, 2), moe_batches=(1, 4), moe_goal_batch=4, moe_iters=1,
                fp8_shapes=((32, 64),), fp8_batches=(1, 4), fp8_iters=1,
                profile_batches=(1, 2), profile_steps=2, profile_prompt_len=8, roofline_profile_steps=2,
                # The CPU smoke run checks that every section runs, not how fast: its limits only
                # guard against a hang, so a busy machine (parallel tests) cannot skip a section.
                tests_timeout_s=900.0, deadline_s=3600.0)


def engine_args(plan: Plan, **overrides) -> dict:
    """`LLM(model, **engine_args(plan))`: bf16 and the Triton backend, as a learner's GPU run."""
    kw = dict(dtype="bfloat16", device=plan.device, attention_backend="triton", block_size=plan.block_size,
              max_num_seqs=plan.max_num_seqs, max_num_batched_tokens=plan.max_num_batched_tokens,
              max_model_len=plan.max_model_len, enable_prefix_caching=True)
    if plan.kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = plan.kv_cache_memory_bytes
    else:
        kw["gpu_memory_utilization"] = plan.gpu_memory_utilization
    kw.update(overrides)
    return kw


def free_device_memory(device: str) -> None:
    """Drop what a finished section left behind before the next one measures."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
