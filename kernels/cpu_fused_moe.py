"""The CPU path of a mixture-of-experts layer: a grouped GEMM over pairs sorted by expert.

vLLM counterpart: `vllm/model_executor/layers/fused_moe/experts/cpu_moe.py`
(`CPUUnquantizedExperts`, which calls the CPU build's `cpu_fused_moe` op: a
grouped GEMM on weights packed once at load time).

Same contract as `mini_vllm.models.fused_moe.fused_experts_reference`
(shapes, expert_map, fp32 accumulation, output in hidden's dtype).

How: the (token, slot) pairs are sorted by local expert once (a stable
argsort), the hidden rows gathered once into that order, and each expert
with tokens runs gate_up, SiLU-and-mul and down on its contiguous slice;
the rows are then weighted in fp32, put back in pair order and summed per
token. The reference instead searches all E experts for their tokens
(E `nonzero` calls even when k of them are busy, as in a decode step) and
scatter-adds per expert.

The products run on the C++ GEMM of `csrc/cpu_gemm.h` (`cpu_layer_ops_native.linear`)
where it takes the shapes (N a multiple of 32, even K in bf16; AVX2 with FMA or
AVX-512) on each expert's weight packed once, else `F.linear`. On an AVX2 CPU
that matters most for bf16: torch's bf16 matmul there is slow, the C++ kernel
widens the packed bf16 weight in registers and accumulates in fp32.

Invariants:
* pairs with topk_ids -1, or whose expert expert_map marks -1, are never
  computed and add nothing;
* a packed copy belongs to its weight tensor (a weak key: freed with it) and
  is rebuilt when the weight's version counter moves (written in place), so
  it is never read stale; a weight without a version counter (created under
  `torch.inference_mode`) or with autograd to record is not packed;
* which GEMM runs depends on the weights' shape, dtype and the CPU, never on
  the number of tokens.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from mini_vllm.kernels import cpu_layer_ops, cpu_layer_ops_native as native_ops
from mini_vllm.kernels.fused_moe_checks import check_fused_experts_args

CPU_DTYPES = (torch.float32, torch.bfloat16)
# id(weight) -> (weak reference to it, its version, packed [E, ...]); an entry leaves
# with its weight (weakref.finalize), so a new tensor at a reused address never finds it.
_PACKED: dict[int, tuple] = {}


def _packable(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (not torch.is_grad_enabled() or not w.requires_grad) and not w.is_inference() \
        and native_ops.handles_linear(x, w[0])


def _packed(w: torch.Tensor) -> torch.Tensor:
    """Every expert's weight [N, K] in the C++ GEMM's layout, packed[e] contiguous."""
    hit = _PACKED.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    with torch.no_grad():
        packed = torch.stack([native_ops.pack_linear_weight(w[e]) for e in range(w.shape[0])])
    if hit is None:
        weakref.finalize(w, _PACKED.pop, id(w), None)
    _PACKED[id(w)] = (weakref.ref(w), w._version, packed)
    return packed


def fused_experts_cpu(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The experts of an MoE layer on CPU tensors: [T, H] in hidden's dtype."""
    check_fused_experts_args(hidden, w13, w2, topk_weights, topk_ids, expert_map)
    if hidden.device.type != "cpu" or hidden.dtype not in CPU_DTYPES:
        raise ValueError(f"the CPU path takes CPU tensors in float32 or bfloat16, got hidden "
                         f"{hidden.dtype} on {hidden.device}")
    num_tokens, hidden_size = hidden.shape
    num_local, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    local = topk_ids.reshape(-1).long()
    if expert_map is not None:
        local = torch.where(local >= 0, expert_map.long()[local.clamp(min=0)], local)
    # Stable sort: -1 (skipped) pairs first, then each expert's pairs in order.
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local + 1, minlength=num_local + 1).tolist()
    pairs = order[counts[0]:]
    xs = hidden[pairs // top_k]
    ys = torch.empty(pairs.numel(), hidden_size, dtype=hidden.dtype)
    native = _packable(hidden, w13) and _packable(hidden, w2)
    p13, p2 = (_packed(w13), _packed(w2)) if native else (None, None)
    start = 0
    for e, n in enumerate(counts[1:]):
        if n == 0:
            continue  # no token chose this expert
        x, y = xs[start:start + n], ys[start:start + n]
        if native:
            gate_up = torch.empty(n, 2 * inter, dtype=hidden.dtype)
            native_ops.linear(x, p13[e], None, gate_up)
            native_ops.linear(cpu_layer_ops.silu_and_mul(gate_up), p2[e], None, y)
        else:
            gate_up = F.linear(x, w13[e])
            torch.mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[e].t(), out=y)
        start += n
    rows = torch.zeros(num_tokens * top_k, hidden_size, dtype=torch.float32)
    rows[pairs] = ys.float() * topk_weights.reshape(-1)[pairs].float()[:, None]
    return rows.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
