"""Triton fused mixture-of-experts: align tokens by expert, two grouped GEMMs, a sum.

vLLM counterparts: `moe_align_block_size`
(`vllm/model_executor/layers/fused_moe/moe_align_block_size.py`, a CUDA op
there, Triton here), `fused_moe_kernel` and `fused_experts_impl`
(`vllm/model_executor/layers/fused_moe/fused_moe.py`) and `moe_sum`.

Shapes (vLLM's): hidden [T, H]; w13 [E, 2I, H], gate rows then up rows;
w2 [E, H, I]; topk_weights [T, k] float; topk_ids [T, k] int (global ids);
expert_map [E_global] int, the local index of a global expert or -1 where
another rank holds it. A "flat id" is f = t * k + j, one (token, slot) pair.

The three steps:
1. `moe_align_block_size` sorts the flat ids by expert into segments padded
   to a multiple of BLOCK_M with the sentinel T * k, so every BLOCK_M block
   of the sorted list belongs to one expert (`expert_ids`, per block). Two
   launches of `_align_kernel`, a program per chunk of flat ids: one counts
   each expert's ids in its chunk, the other places them (a one-hot
   [chunk, E] prefix sum ranks each id among its expert's; the earlier
   chunks' counts and the expert's segment start are its base);
2. `_moe_gemm_kernel`, once per projection: a program owns one block of
   BLOCK_M flat ids and BLOCK_N output columns, gathers the rows it needs
   (token f // k for gate_up, flat row f for down) and multiplies them by its
   expert's weight. gate_up keeps a gate and an up accumulator and stores
   silu(gate) * up (SiLU-and-mul fused into its epilogue: the [T*k, 2I]
   intermediate is never written); down multiplies in the top-k weight and
   stores each flat row in fp32;
3. `_moe_sum_kernel`: out[t] = sum_j rows[t * k + j], cast once to hidden's dtype.

Invariants:
* every flat id with an expert (topk_ids >= 0) appears exactly once in
  `sorted_token_ids`, in its expert's segment (segments are by global id;
  a non-local expert's blocks are labelled -1); a flat id with topk_ids -1
  appears nowhere; every other slot holds the sentinel;
* a sentinel (padding) row is never loaded and never stored: its mask is
  `flat id < T * k`, so padding reaches no output;
* a block whose expert is -1 (not on this rank) returns at once; its flat
  rows keep the zeros they were allocated with and add nothing to the sum;
* accumulation in fp32; fp32 inputs use IEEE fp32 dots (no TF32); bf16/fp16
  feed their own dtype to the tensor cores on a GPU; under the interpreter
  they are upcast first, because it gets bf16 arithmetic wrong.
The launch needs no host synchronisation beyond the argument checks (which
read topk_ids' range back): the grid is sized for the worst-case padding.
"""
from __future__ import annotations

import torch

from .triton_setup import interpreting, require_triton_mode

require_triton_mode(__name__)  # before triton is first imported: see triton_setup.py

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mini_vllm.kernels.fused_moe_checks import check_expert_ids, check_fused_experts_args

ALIGN_CHUNK = 256  # most flat ids one align program reads


@triton.jit
def _align_kernel(topk_ids_ptr, counts_ptr, bases_ptr, offsets_ptr, sorted_ptr, numel, num_experts,
                  SCATTER: tl.constexpr, CHUNK: tl.constexpr, E_P: tl.constexpr):
    """Program c owns flat ids [c * CHUNK, (c + 1) * CHUNK).

    Count phase: counts[c, e] = how many of its ids go to expert e.
    Scatter phase: id f of expert e goes to offsets[e] + bases[c, e] + its rank
    among the chunk's ids of e (bases: the earlier chunks' counts), so each
    segment lists its expert's ids in increasing order.
    """
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < numel, other=-1)
    experts = tl.arange(0, E_P)
    hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_P] one-hot; -1 hits nothing
    row = c.to(tl.int64) * num_experts + experts
    e_ok = experts < num_experts
    if not SCATTER:
        tl.store(counts_ptr + row, tl.sum(hit, 0), mask=e_ok)
    else:
        # Inclusive prefix sum down the chunk, read at each id's own expert: rank + 1.
        rank = tl.sum(tl.cumsum(hit, 0) * hit, 1) - 1
        base = tl.load(offsets_ptr + experts, mask=e_ok, other=0) + tl.load(bases_ptr + row, mask=e_ok, other=0)
        pos = tl.sum(hit * base[None, :], 1) + rank
        tl.store(sorted_ptr + pos, offs.to(tl.int32), mask=ids >= 0)


def _max_padded(numel: int, num_experts: int, block_m: int) -> int:
    # At most min(numel, E) experts get tokens, each wasting < BLOCK_M slots.
    return numel + min(numel, num_experts) * (block_m - 1)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None = None):
    """topk_ids [T, k] -> (sorted_token_ids int32 [P], expert_ids int32 [P // block_size],
    num_tokens_post_padded int32 [1]).

    Segments follow expert order 0..E-1, each the expert's flat ids in
    increasing order, padded to a multiple of block_size with the sentinel
    T * k; only experts with tokens get a segment. expert_ids holds each
    block's local expert (expert_map[e], or e), -1 for a non-local expert and
    for the blocks past num_tokens_post_padded. topk_ids -1 go nowhere.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if expert_map is not None and expert_map.numel() != num_experts:
        raise ValueError(f"expert_map must have num_experts={num_experts} entries, got {expert_map.numel()}")
    check_expert_ids(topk_ids, num_experts, expert_map)
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    numel = flat.numel()
    max_padded = _max_padded(numel, num_experts, block_size)
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    num_blocks = triton.cdiv(max_padded, block_size)
    if numel == 0:
        return (sorted_ids, torch.full((num_blocks,), -1, dtype=torch.int32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device))
    e_p = triton.next_power_of_2(num_experts)
    chunk = max(16, min(ALIGN_CHUNK, 8192 // e_p, triton.next_power_of_2(numel)))  # [chunk, e_p] in registers
    num_chunks = triton.cdiv(numel, chunk)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    _align_kernel[(num_chunks,)](flat, counts, counts, counts, sorted_ids, numel, num_experts,
                                 SCATTER=False, CHUNK=chunk, E_P=e_p)
    bases = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    padded = (counts.sum(0) + block_size - 1) // block_size * block_size
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    _align_kernel[(num_chunks,)](flat, counts, bases, offsets, sorted_ids, numel, num_experts,
                                 SCATTER=True, CHUNK=chunk, E_P=e_p)
    # Block b belongs to the expert whose segment holds slot b * block_size.
    starts = torch.arange(num_blocks, dtype=torch.int32, device=device) * block_size
    owner = torch.searchsorted(offsets, starts, right=True) - 1
    ntpp = offsets[num_experts:]
    labels = owner if expert_map is None else expert_map.to(device)[owner.clamp(max=num_experts - 1)]
    expert_ids = torch.where(starts < ntpp, labels, -1).to(torch.int32)
    return sorted_ids, expert_ids, ntpp.clone()


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr,
                     N, K, num_valid,
                     stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                     ROWS_PER_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     NATIVE_DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[f, n] = A[f // ROWS_PER_TOKEN] . B[expert, n] for the flat ids f of one block.

    GATED: B holds 2N rows (gate then up); C = silu(A.gate) * (A.up).
    MUL_WEIGHT: C is scaled by topk_weights[f] (in fp32, before the store).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return  # past the last expert's segment
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return  # expert on another rank: its rows stay zero
    flat = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = flat < num_valid  # the sentinel marks padding
    a_row = a_ptr + (flat // ROWS_PER_TOKEN)[:, None] * stride_am
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(a_row + kk[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & n_ok[None, :]
        b = tl.load(b_base + kk[:, None] * stride_bk + n[None, :] * stride_bn, mask=b_mask, other=0.0)
        if NATIVE_DOT:
            acc = tl.dot(a, b, acc)
        else:
            a = a.to(tl.float32)
            acc = tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
        if GATED:
            b_up = tl.load(b_base + kk[:, None] * stride_bk + (n + N)[None, :] * stride_bn, mask=b_mask,
                           other=0.0)
            if NATIVE_DOT:
                acc_up = tl.dot(a, b_up, acc_up)
            else:
                acc_up = tl.dot(a, b_up.to(tl.float32), acc_up, input_precision="ieee")
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        w = tl.load(topk_weights_ptr + flat, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c = c_ptr + flat[:, None] * stride_cm + n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(rows_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, h] = sum_j rows[t * TOP_K + j, h] (rows fp32 [T * TOP_K, H])."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + j) * H + h, mask=ok, other=0.0)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _block_m(numel: int, num_experts: int) -> int:
    # BLOCK_M near the mean rows per expert: decode batches waste little padding,
    # prefills get bigger tiles (vLLM's default config does the same by batch).
    per_expert = numel / max(1, num_experts)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def _launch_gemm(a, b, c, topk_weights, sorted_ids, expert_ids, ntpp, n_out, rows_per_token, gated, mul_weight,
                 block_m, native):
    k_dim = a.shape[1]
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    block_k = min(64, max(16, triton.next_power_of_2(k_dim)))
    grid = (expert_ids.numel(), triton.cdiv(n_out, block_n))
    _moe_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, ntpp, n_out, k_dim, c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        ROWS_PER_TOKEN=rows_per_token, GATED=gated, MUL_WEIGHT=mul_weight, NATIVE_DOT=native,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_experts_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         expert_map: torch.Tensor | None = None, block_m: int | None = None) -> torch.Tensor:
    """The experts of an MoE layer: [T, H] in hidden's dtype (see the module docstring).

    block_m (a power of two >= 16) overrides the tile height chosen from the
    routing; tests use it to split one expert's tokens over several blocks.
    """
    num_experts = check_fused_experts_args(hidden, w13, w2, topk_weights, topk_ids, expert_map)
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    numel = num_tokens * top_k
    if block_m is None:
        block_m = _block_m(numel, num_experts)
    elif block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16 (tl.dot's minimum), got {block_m}")
    out = torch.empty_like(hidden)
    if numel == 0:
        return out
    sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, block_m, num_experts, expert_map)
    native = hidden.dtype != torch.float32 and not interpreting()
    weights = topk_weights.to(torch.float32).reshape(-1).contiguous()
    act = torch.empty(numel, inter, dtype=hidden.dtype, device=hidden.device)
    _launch_gemm(hidden, w13, act, weights, sorted_ids, expert_ids, ntpp, inter, top_k, True, False,
                 block_m, native)
    # Zeros: flat rows of a non-local expert or of topk_ids -1 are never written.
    rows = torch.zeros(numel, hidden_size, dtype=torch.float32, device=hidden.device)
    _launch_gemm(act, w2, rows, weights, sorted_ids, expert_ids, ntpp, hidden_size, 1, False, True,
                 block_m, native)
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](rows, out, hidden_size, TOP_K=top_k,
                                                                     BLOCK_H=block_h)
    return out
