"""Which implementation runs a mixture-of-experts layer's experts.

vLLM counterpart: the choice `FusedMoE` makes of its experts implementation
(`vllm/model_executor/layers/fused_moe/fused_moe.py`, `fused_experts`, on
CUDA; `vllm/model_executor/layers/fused_moe/experts/cpu_moe.py` on the CPU).

`fused_experts(hidden, w13, w2, topk_weights, topk_ids, expert_map=None)`
has the contract of `reference.fused_experts_reference` (shapes, expert_map,
float32 accumulation, output in hidden's dtype) whatever runs it.

Invariants:
* "auto" (the default) picks the Triton kernel for CUDA tensors, the CPU path
  (`kernels/cpu_fused_moe.py`) for fp32 and bf16 CPU tensors, and the
  reference for anything else (fp16 on the CPU, other devices); every
  implementation equals the reference up to summation order (and, in bf16,
  the rounding of intermediates the reference does in bf16);
* `MINI_VLLM_MOE_IMPL` (reference | triton | cpu | auto) forces one, read at
  each call so a test can switch it; any other value is an error naming the
  variable and the allowed values, never silently "auto";
* a forced implementation that cannot run (Triton not importable) raises
  instead of falling back, so a test that forces it cannot pass on the
  reference by accident.
"""
from __future__ import annotations

import os

import torch

from mini_vllm.models.fused_moe.reference import fused_experts_reference

MOE_IMPL_ENV = "MINI_VLLM_MOE_IMPL"
MOE_IMPLS = ("auto", "reference", "triton", "cpu")


def moe_impl() -> str:
    """The implementation the environment asks for (default "auto")."""
    value = os.environ.get(MOE_IMPL_ENV, "auto").strip().lower() or "auto"
    if value not in MOE_IMPLS:
        raise ValueError(f"{MOE_IMPL_ENV}={value!r} is not one of {', '.join(MOE_IMPLS)}")
    return value


def _triton_experts():
    from mini_vllm.kernels import prepare_triton

    prepare_triton()  # without CUDA: Triton's interpreter, selected before triton is imported
    from mini_vllm.kernels.fused_moe import fused_experts_triton
    return fused_experts_triton


def _cpu_experts():
    from mini_vllm.kernels.cpu_fused_moe import fused_experts_cpu
    return fused_experts_cpu


def select_impl(hidden: torch.Tensor) -> str:
    """The implementation `fused_experts` runs for `hidden` ("reference", "triton", "cpu")."""
    impl = moe_impl()
    if impl != "auto":
        return impl
    if hidden.is_cuda and hidden.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return "triton"
    if hidden.device.type == "cpu" and hidden.dtype in (torch.float32, torch.bfloat16):
        return "cpu"
    return "reference"  # fp16 on the CPU, other devices


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]), in hidden's dtype."""
    impl = select_impl(hidden)
    if impl == "triton":
        fn = _triton_experts()
    elif impl == "cpu":
        fn = _cpu_experts()
    else:
        fn = fused_experts_reference
    return fn(hidden, w13, w2, topk_weights, topk_ids, expert_map)
