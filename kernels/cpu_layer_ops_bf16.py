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
def _norm_row_bf16(x, r, weight, eps, out):
    """out[r] = bf16(weight * bf16(x[r] / sqrt(mean(x[r]^2) + eps)))."""
    hidden = x.shape[1]
    ss = np.float32(0.0)
    for j in range(hidden):
        v = _bf16_to_fp32(x[r, j])
        ss += v * v
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(hidden) + eps)
    for j in range(hidden):
        normed = _bf16_to_fp32(_fp32_to_bf16(_bf16_to_fp32(x[r, j]) * inv))
        out[r, j] = _fp32_to_bf16(_bf16_to_fp32(weight[j]) * normed)


@njit(cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def rms_norm_rows_bf16(x, weight, eps, out):
    for r in prange(x.shape[0]):
        _norm_row_bf16(x, r, weight, eps, out)


@njit(cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def add_rms_norm_rows_bf16(x, residual, weight, eps, out, residual_out):
    for r in prange(x.shape[0]):
        for j in range(x.shape[1]):
            residual_out[r, j] = _fp32_to_bf16(_bf16_to_fp32(x[r, j]) + _bf16_to_fp32(residual[r, j]))
        _norm_row_bf16(residual_out, r, weight, eps, out)  # the row is still in L1


@njit(cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def silu_and_mul_rows_bf16(x, out):
    rows, inter = out.shape
    one = np.float32(1.0)
    for r in prange(rows):
        for j in range(inter):
            g = _bf16_to_fp32(x[r, j])
            silu = _bf16_to_fp32(_fp32_to_bf16(g / (one + _exp(-g))))
            out[r, j] = _fp32_to_bf16(silu * _bf16_to_fp32(x[r, inter + j]))


@njit(cache=True, parallel=True, error_model="numpy")  # no fastmath: each product rounded, as torch
def rope_rows_bf16(positions, x, cos_cache, sin_cache, head_size, out):
    tokens, width = x.shape
    half = head_size // 2
    max_position = cos_cache.shape[0]
    for t in range(tokens):  # checked first, on the calling thread, so no worker thread raises
        if positions[t] < 0 or positions[t] >= max_position:
            raise IndexError("rotary_embedding: a position is outside the cos/sin table")
    for t in prange(tokens):
        p = positions[t]
        # The token's cos/sin row narrowed to bf16 (as torch's .to()) once, not once per head:
        # Qwen3-0.6B rotates 24 heads of q and k per token.
        cos_row, sin_row = np.empty(half, np.float32), np.empty(half, np.float32)
        for j in range(half):
            cos_row[j] = _bf16_to_fp32(_fp32_to_bf16(cos_cache[p, j]))
            sin_row[j] = _bf16_to_fp32(_fp32_to_bf16(sin_cache[p, j]))
        for base in range(0, width, head_size):
            for j in range(half):
                c, s = cos_row[j], sin_row[j]
                x1, x2 = _bf16_to_fp32(x[t, base + j]), _bf16_to_fp32(x[t, base + half + j])
                x1c, x2s = _bf16_to_fp32(_fp32_to_bf16(x1 * c)), _bf16_to_fp32(_fp32_to_bf16(x2 * s))
                x2c, x1s = _bf16_to_fp32(_fp32_to_bf16(x2 * c)), _bf16_to_fp32(_fp32_to_bf16(x1 * s))
                out[t, base + j] = _fp32_to_bf16(x1c - x2s)
                out[t, base + half + j] = _fp32_to_bf16(x2c + x1s)
