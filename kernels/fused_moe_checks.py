"""Argument checks shared by the fused-MoE kernels (Triton and CPU), so both
reject bad input with the same message.

vLLM counterpart: the asserts at the top of `fused_experts_impl` and
`moe_align_block_size` (`vllm/model_executor/layers/fused_moe/`), here
ValueErrors that name the field and the allowed range.

A bad expert id would make a kernel read another expert's (or no) weights,
so ids are range-checked: one small read-back of topk_ids' min and max.
"""
from __future__ import annotations

import torch

from mini_vllm.kernels.validation import check_tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None,
                     num_local: int | None = None) -> None:
    """topk_ids [T, k] in [-1, num_experts) (-1: no expert); expert_map [num_experts]
    with entries in [-1, num_local)."""
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES)
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"topk_ids must lie in [-1, num_experts={num_experts}) (-1: no expert), "
                             f"got values in [{lo}, {hi}]")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, ndim=1, dtypes=INDEX_DTYPES, device=topk_ids.device)
        if num_local is not None and expert_map.numel():
            lo, hi = int(expert_map.min()), int(expert_map.max())
            if lo < -1 or hi >= num_local:
                raise ValueError(f"expert_map entries must lie in [-1, local experts={num_local}) "
                                 f"(-1: expert on another rank), got values in [{lo}, {hi}]")


def check_fused_experts_args(hidden, w13, w2, topk_weights, topk_ids, expert_map) -> int:
    """Shapes, dtypes, devices and id ranges of `fused_experts`; returns the
    number of global experts (expert_map's length, else w13's first dim)."""
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    dev = hidden.device
    check_tensor("w13", w13, ndim=3, dtypes=(hidden.dtype,), device=dev)
    check_tensor("w2", w2, ndim=3, dtypes=(hidden.dtype,), device=dev)
    num_local, two_i, h_in = w13.shape
    if h_in != hidden.shape[1] or two_i % 2:
        raise ValueError(f"w13 must be [num_experts, 2 * intermediate, hidden={hidden.shape[1]}], "
                         f"got {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_local, hidden.shape[1], two_i // 2):
        raise ValueError(f"w2 must be [num_experts={num_local}, hidden={hidden.shape[1]}, "
                         f"intermediate={two_i // 2}], got {tuple(w2.shape)}")
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, device=dev)
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [num_tokens={hidden.shape[0]}, top_k]")
    if topk_ids.shape[1] < 1:
        raise ValueError("top_k (topk_ids.shape[1]) must be >= 1")
    num_experts = expert_map.numel() if expert_map is not None else num_local
    check_expert_ids(topk_ids, num_experts, expert_map, num_local)
    return num_experts
