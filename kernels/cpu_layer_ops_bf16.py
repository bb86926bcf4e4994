"""The fused CPU layer ops of `cpu_layer_ops.py` for bf16 models, rounded where torch rounds.

vLLM counterpart: the bf16 instantiations of `csrc/cpu/layernorm.cpp`,
`activation.cpp` and `pos_encoding.cpp` (vLLM's CPU kernels are templates
over fp32 / bf16 / fp16, widening each vector to fp32 and narrowing the result).

Why: in a bf16 model every torch elementwise op widens its inputs to fp32,
computes, and rounds back to bf16, one op at a time. RMSNorm is then seven
passes (widen, square, mean, rsqrt, multiply, narrow, scale) and the rotation
of q and k about a dozen, each a small call: about 2.5 of 12.7 s of CPU time
on the Qwen3-0.6B-shaped workload at one thread, and calls this small gain
nothing from a second thread.

numba has no bf16 type: the loops read and write the raw 16 bits (uint16),
widen a value by moving its bits to the top of an fp32 (`_bf16_to_fp32`), and
narrow one by rounding to nearest even (`_fp32_to_bf16`, what torch's
bf16 conversion does, NaN kept a quiet NaN).

Contract: the torch code of `mini_vllm.models.layers` / `rotary` for bf16
tensors is the reference, and each op rounds to bf16 at the same points:
* RMSNorm: x widened, its mean square and scale in fp32, the normalised value
  narrowed, then multiplied by the (bf16) weight and narrowed again (HF's
  order); after the residual add, the sum is narrowed first (the new residual);
* SiLU-and-mul: silu(gate) narrowed, then times up, narrowed;
* rotary: cos and sin narrowed to bf16, each product narrowed, then their
  difference (sum) narrowed.
The rotation is bit-exact (a product of two bf16 values is exact in fp32).
RMSNorm sums in another order than torch's mean and SiLU uses the kernels'
`_exp` (relative error under 1e-7), so those two may differ from torch by one
bf16 rounding step where a value lies within an fp32 ulp of a rounding
boundary; the tests bound that.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu_paged_attention import _FASTMATH, _bf16_to_fp32, _exp


@njit(cache=True, inline="always")
def _fp32_to_bf16(x):
    """float32 -> bf16 bits, rounded to nearest even (ties to the even mantissa)."""
    u = np.float32(x).view(np.uint32)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)  # NaN: a quiet NaN, as torch gives
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(cache=True, inline="always", fastmath=_FASTMATH, error_model="numpy")
def _norm_row_bf16(x, weight, eps, out):
    """out = bf16(weight * bf16(x / sqrt(mean(x^2) + eps))), for one row (1-D views)."""
    hidden = x.shape[0]
    ss = np.float32(0.0)
    for j in range(hidden):
        v = _bf16_to_fp32(x[j])
        ss += v * v
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(hidden) + eps)
    for j in range(hidden):
        normed = _bf16_to_fp32(_fp32_to_bf16(_bf16_to_fp32(x[j]) * inv))
        out[j] = _fp32_to_bf16(_bf16_to_fp32(weight[j]) * normed)


# As in cpu_layer_ops.py, the inner loops index 1-D views of a row or a head, which
# LLVM vectorises (2-D indexing kept the rotary loop scalar: 6x slower).

@njit(cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def rms_norm_rows_bf16(x, weight, eps, out):
    for r in prange(x.shape[0]):
        _norm_row_bf16(x[r], weight, eps, out[r])


@njit(cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def add_rms_norm_rows_bf16(x, residual, weight, eps, out, residual_out):
    for r in prange(x.shape[0]):
        xr, rr, sr = x[r], residual[r], residual_out[r]
        for j in range(xr.shape[0]):
            sr[j] = _fp32_to_bf16(_bf16_to_fp32(xr[j]) + _bf16_to_fp32(rr[j]))
        _norm_row_bf16(sr, weight, eps, out[r])  # the row is still in L1


@njit(cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def silu_and_mul_rows_bf16(x, out):
    rows, inter = out.shape
    one = np.float32(1.0)
    for r in prange(rows):
        gate, up, o = x[r, :inter], x[r, inter:], out[r]
        for j in range(inter):
            g = _bf16_to_fp32(gate[j])
            silu = _bf16_to_fp32(_fp32_to_bf16(g / (one + _exp(-g))))
            o[j] = _fp32_to_bf16(silu * _bf16_to_fp32(up[j]))


@njit(cache=True)
def _check_positions(positions, max_position):
    """Run first, on the calling thread, so that no worker thread raises (fp32 and bf16 rotary)."""
    for t in range(positions.shape[0]):
        if positions[t] < 0 or positions[t] >= max_position:
            raise IndexError("rotary_embedding: a position is outside the cos/sin table")


@njit(cache=True, inline="always", error_model="numpy")
def _narrow_table_row(table, p, row):
    """row[:] = table[p] narrowed to bf16 and widened back (torch's .to() of cos/sin)."""
    for j in range(row.shape[0]):
        row[j] = _bf16_to_fp32(_fp32_to_bf16(table[p, j]))


@njit(cache=True, inline="always", error_model="numpy")
def _rotate_head_bf16(x1, x2, cos, sin, o1, o2):
    """One head's neox rotation, each product narrowed before the difference and the sum."""
    for j in range(x1.shape[0]):
        a, b = _bf16_to_fp32(x1[j]), _bf16_to_fp32(x2[j])
        ac, bs = _bf16_to_fp32(_fp32_to_bf16(a * cos[j])), _bf16_to_fp32(_fp32_to_bf16(b * sin[j]))
        bc, as_ = _bf16_to_fp32(_fp32_to_bf16(b * cos[j])), _bf16_to_fp32(_fp32_to_bf16(a * sin[j]))
        o1[j] = _fp32_to_bf16(ac - bs)
        o2[j] = _fp32_to_bf16(bc + as_)


@njit(cache=True, parallel=True, error_model="numpy")  # no fastmath: each product rounded, as torch
def rope_rows_bf16(positions, x, cos_cache, sin_cache, head_size, out):
    tokens, width = x.shape
    half = head_size // 2
    _check_positions(positions, cos_cache.shape[0])
    for t in prange(tokens):
        # The token's cos/sin row narrowed once, not once per head (Qwen3-0.6B rotates 24 heads).
        cos, sin = np.empty(half, np.float32), np.empty(half, np.float32)
        _narrow_table_row(cos_cache, positions[t], cos)
        _narrow_table_row(sin_cache, positions[t], sin)
        for base in range(0, width, head_size):
            _rotate_head_bf16(x[t, base:base + half], x[t, base + half:base + head_size], cos, sin,
                              out[t, base:base + half], out[t, base + half:base + head_size])


# The norm of one head, compiled on its own with fastmath (as in rms_norm_rows_bf16).
_norm_head_bf16 = njit(cache=True, fastmath=_FASTMATH, error_model="numpy")(_norm_row_bf16.py_func)


@njit(cache=True, inline="always", error_model="numpy")
def _norm_rotate_heads_bf16(src, weight, eps, cos, sin, normed, dst):
    """dst = each head of src (one token's q or k) normed with `weight`, then rotated;
    `normed` is the caller's scratch for one head."""
    head_size = normed.shape[0]
    half = head_size // 2
    for a in range(0, src.shape[0], head_size):
        _norm_head_bf16(src[a:a + head_size], weight, eps, normed)
        _rotate_head_bf16(normed[:half], normed[half:], cos, sin, dst[a:a + half], dst[a + half:a + head_size])


@njit(cache=True, parallel=True, error_model="numpy")  # no fastmath: each product rounded, as torch
def qk_norm_rope_rows_bf16(positions, qkv, q_heads, k_heads, head_size, q_weight, k_weight, eps, cos_cache,
                           sin_cache, q_out, k_out):
    half = head_size // 2
    _check_positions(positions, cos_cache.shape[0])
    for t in prange(qkv.shape[0]):
        cos, sin = np.empty(half, np.float32), np.empty(half, np.float32)
        _narrow_table_row(cos_cache, positions[t], cos)
        _narrow_table_row(sin_cache, positions[t], sin)
        normed = np.empty(head_size, np.uint16)
        q_end = q_heads * head_size
        _norm_rotate_heads_bf16(qkv[t, :q_end], q_weight, eps, cos, sin, normed, q_out[t])
        _norm_rotate_heads_bf16(qkv[t, q_end:q_end + k_heads * head_size], k_weight, eps, cos, sin, normed, k_out[t])
