"""KV cache sizing: the block count `gpu_memory_utilization` chose and the memory left.

vLLM counterpart: `Worker.determine_available_memory`
(`vllm/v1/worker/gpu_worker.py`) and the "Available KV cache memory" line it
logs. The engine's worker (`mini_vllm/worker.py`) profiles one forward pass of
`max_num_batched_tokens` tokens and gives the KV cache
`gpu_memory_utilization x total - peak`. This section starts the engine that
way, records the blocks and bytes it chose, then runs the heaviest step the
scheduler can build (full prompts filling the token budget) and reports the
peak the allocator reached and the memory the device still had free.

On a CPU (`--small`) the budget is `kv_cache_memory_bytes`; the host's
numbers fill the same fields and the allocator's are null.
"""
from __future__ import annotations

import torch

from gpu_check_parts.environment import device_info
from gpu_check_parts.plan import Plan, engine_args


def run(model_dir: str, plan: Plan, vocab: int) -> dict:
    from mini_vllm import LLM, SamplingParams

    cuda = plan.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    llm = LLM(model_dir, **engine_args(plan))
    core = llm.llm_engine.engine_core.engine_core
    n_blocks, per_block = core.num_gpu_blocks, core.executor.bytes_per_block
    weights = core.executor.collective_rpc(
        lambda worker: sum(p.numel() * p.element_size() for p in worker.model.parameters()))[0]
    total = torch.cuda.mem_get_info()[1] if cuda else device_info("cpu")["total_memory_bytes"]
    out = {"budget_rule": "gpu_memory_utilization" if plan.kv_cache_memory_bytes is None else "kv_cache_memory_bytes",
           "gpu_memory_utilization": plan.gpu_memory_utilization if cuda else None,
           "kv_cache_memory_bytes": plan.kv_cache_memory_bytes, "total_bytes": total, "weights_bytes": weights,
           "num_gpu_blocks": n_blocks, "bytes_per_block": per_block, "kv_cache_bytes": n_blocks * per_block,
           "kv_tokens": n_blocks * plan.block_size}
    if cuda:
        free, _ = torch.cuda.mem_get_info()
        out.update(free_bytes_after_init=free, torch_reserved_bytes_after_init=torch.cuda.memory_reserved())
        torch.cuda.reset_peak_memory_stats()
    # The heaviest step: full prompts that fill max_num_batched_tokens at once.
    prompt_len = plan.max_model_len - 8
    count = max(1, min(plan.max_num_seqs, plan.max_num_batched_tokens // prompt_len))
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()}
               for _ in range(count)]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    out["heavy_step"] = {"prompts": count, "prompt_len": prompt_len}
    if cuda:
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        peak = torch.cuda.max_memory_reserved()
        non_torch = (total - free) - torch.cuda.memory_reserved()  # CUDA context, cuBLAS workspaces, ...
        out.update(free_bytes_after_heavy_step=free, torch_peak_reserved_bytes=peak,
                   non_torch_bytes=non_torch, peak_used_fraction=(peak + non_torch) / total,
                   within_utilization=(peak + non_torch) <= plan.gpu_memory_utilization * total)
    else:
        out.update(free_bytes_after_init=None, torch_reserved_bytes_after_init=None, free_bytes_after_heavy_step=None,
                   torch_peak_reserved_bytes=None, non_torch_bytes=None, peak_used_fraction=None,
                   within_utilization=n_blocks * per_block <= plan.kv_cache_memory_bytes)
    llm.shutdown()
    return out
