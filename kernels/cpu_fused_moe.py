"""The CPU path of a mixture-of-experts layer: a grouped GEMM over pairs sorted by expert.

vLLM counterpart: `vllm/model_executor/layers/fused_moe/experts/cpu_moe.py`
(`CPUUnquantizedExperts`, which calls the CPU build's `cpu_fused_moe` op: a
grouped GEMM on weights packed once at load time).

Same contract as `mini_vllm.models.fused_moe.fused_experts_reference`
(shapes, expert_map, fp32 accumulation, output in hidden's dtype).

How (C++, where `cpu_layer_ops_native.handles_linear` takes both weights: N a multiple
of 32, even K in bf16; AVX2 with FMA or AVX-512): one call per layer,
`cpu_fused_moe_native.fused_experts` (csrc/cpu_moe.h). It sorts the (token, slot) pairs
by local expert (a stable counting sort), gathers the hidden rows once into that order,
runs gate_up, SiLU-and-mul and down for every expert with tokens on its weights packed
once (`_packed`, the layout of csrc/cpu_gemm.h), and sums each token's rows weighted in
fp32, all (expert, panel) items of the layer in one parallel region. Before it, a decode
step made two C++ calls per busy expert from a Python loop, and with two threads woke the
thread team for each: 0.65x vLLM's speed on bench_moe_vs_vllm.py.

Elsewhere (`_experts_f_linear`): the same sort with torch (a stable argsort), then per
expert with tokens F.linear on its contiguous slice, the rows weighted in fp32, put back
in pair order and summed per token. On an AVX2 CPU the C++ path matters most for bf16:
torch's bf16 matmul there is slow, the C++ GEMM widens the packed bf16 weight in
registers and accumulates in fp32. The reference instead searches all E experts for
their tokens (E `nonzero` calls even when k of them are busy) and scatter-adds per expert.

Invariants:
* pairs with topk_ids -1, or whose expert expert_map marks -1, are never
  computed and add nothing;
* a packed copy belongs to its weight tensor (a weak key: freed with it) and
  is rebuilt when the weight's version counter moves (written in place), so
  it is never read stale; a weight without a version counter (created under
  `torch.inference_mode`) or with autograd to record is not packed;
* which GEMM runs depends on the weights' shape, dtype and the CPU, never on
  the number of tokens; the C++ path's bits depend neither on the thread count
  nor on the other tokens' routing.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from mini_vllm.kernels import cpu_fused_moe_native as native_moe, cpu_layer_ops_native as native_ops
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
    native = _packable(hidden, w13) and _packable(hidden, w2)
    if native:
        out = torch.empty(hidden.shape, dtype=hidden.dtype)
        native_moe.fused_experts(hidden, _packed(w13), _packed(w2), topk_weights, topk_ids, expert_map, out)
        return out
    return _experts_f_linear(hidden, w13, w2, topk_weights, topk_ids, expert_map)


def _experts_f_linear(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """The same computation on F.linear, for the shapes and CPUs the C++ GEMM does not take."""
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
    start = 0
    for e, n in enumerate(counts[1:]):
        if n == 0:
            continue  # no token chose this expert
        gate_up = F.linear(xs[start:start + n], w13[e])
        torch.mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[e].t(), out=ys[start:start + n])
        start += n
    rows = torch.zeros(num_tokens * top_k, hidden_size, dtype=torch.float32)
    rows[pairs] = ys.float() * topk_weights.reshape(-1)[pairs].float()[:, None]
    return rows.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
