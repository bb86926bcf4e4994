"""The arithmetic the CPU attention kernel's loops share: widening bf16 and
fp16 bits to fp32, a vectorisable exp, software prefetch, and one step of the
online softmax.

vLLM counterpart: the vector helpers of `csrc/cpu/cpu_types_x86.hpp` (loads
that widen bf16/fp16, exp) used by `csrc/cpu/cpu_attn_impl.hpp`.

Used by `cpu_attention_items.py` (the two per-item loops) and by
`cpu_layer_ops.py` (`_exp`); see `cpu_paged_attention.py` for the kernel.
"""
from __future__ import annotations

import numpy as np

from .cpu_numba import numba  # noqa: F401  (numba set up before its first import below)

from llvmlite import binding as llvm_binding, ir as llvm_ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

# Cache formats: fp32 read as it is, bf16 and fp16 as their raw 16 bits.
FMT_FP32, FMT_BF16, FMT_FP16 = 0, 1, 2
_FASTMATH = {"reassoc", "contract"}
_TWO_POW_112 = np.float32(2.0 ** 112)
_NEG_INF = np.float32(-np.inf)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)  # ln 2 = HI + LO, HI exact in 9 bits


@njit(cache=True)
def _fp16_to_fp32(h):
    """IEEE half bits -> float32. Moving the 15 exponent+mantissa bits up by 13
    gives a float32 whose exponent is biased by 15 instead of 127; multiplying
    by 2**112 rebiases it (subnormal halves come out exact too). Inf/NaN
    (exponent all ones) keep their mantissa and get float32's all-ones exponent."""
    h = np.uint32(h)
    bits = np.uint32(((h & 0x8000) << 16) | ((h & 0x7FFF) << 13))
    if (h & 0x7C00) == 0x7C00:
        return np.uint32(bits | 0x7F800000).view(np.float32)
    return bits.view(np.float32) * _TWO_POW_112


@njit(cache=True, inline="always", fastmath=_FASTMATH, error_model="numpy")
def _exp(x):
    """exp(x) in fp32, for x clamped to [-87, 88] (where exp is a normal fp32).
    Why not np.exp: numba calls libm's expf once per element, so the softmax
    loop (max, exp, sum) takes 2.9 ns a score here; this is plain arithmetic,
    the loop vectorises and takes 0.8 ns (a 512-token prefill at head_dim 128:
    23 -> 18 ms). exp(x) =
    2**n * exp(r) with n = round(x / ln 2) and |r| <= ln(2) / 2: exp(r) is
    Cephes' degree-7 polynomial (relative error < 1e-7), 2**n is n + 127
    written into a float's exponent bits. Scores minus the running max are
    <= 0; below -87 it returns exp(-87) ~ 2e-38 instead of a smaller number,
    nothing next to a row sum >= 1."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO  # in two parts so r keeps its low bits
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * np.uint32((np.int32(n) + 127) << 23).view(np.float32)


@njit(cache=True, inline="always")
def _bf16_to_fp32(bits):
    """bf16 bits -> float32: bf16 is the top half of an fp32."""
    return np.uint32(np.uint32(bits) << 16).view(np.float32)


@njit(cache=True, inline="always")
def _widen_row(cache, phys, slot, kvh, fmt, row):
    """row[:] = the head_dim values of KV head kvh at slot `slot` of physical
    block phys, as fp32. The format branch sits outside the loops so each loop
    vectorises."""
    head_dim = row.shape[0]
    if fmt == FMT_FP32:
        for d in range(head_dim):
            row[d] = cache[phys, slot, kvh, d]
    elif fmt == FMT_BF16:
        for d in range(head_dim):
            row[d] = _bf16_to_fp32(cache[phys, slot, kvh, d])
    else:
        for d in range(head_dim):
            row[d] = _fp16_to_fp32(cache[phys, slot, kvh, d])


@njit(cache=True)
def _widen_block(cache, phys, kvh, n, fmt, tile):
    """tile[:n] = slots 0..n-1 of KV head kvh in physical block phys, as fp32."""
    for j in range(n):
        _widen_row(cache, phys, j, kvh, fmt, tile[j])


_PREFETCH = "llvm.prefetch.p0" if llvm_binding.llvm_version_info >= (15,) else "llvm.prefetch.p0i8"


@intrinsic
def _prefetch(typingctx, flat, i):
    """Ask the CPU to start loading the 64-byte line that holds flat[i] into
    its L2 cache, without waiting for it (x86 `prefetcht1`). Only a hint: it
    never faults and changes no value. numba has no prefetch of its own, so
    this emits LLVM's intrinsic."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        pointer = builder.gep(array.data, [context.cast(builder, args[1], signature.args[1], types.intp)])
        i8p, i32 = llvm_ir.IntType(8).as_pointer(), llvm_ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, llvm_ir.FunctionType(llvm_ir.VoidType(), [i8p] + [i32] * 3),
                                            _PREFETCH)
        # read (0); locality 2, L2 and not L1: lines 1-2 blocks ahead would evict the item's q, acc and scores
        # from the 32 KiB L1; data (1)
        builder.call(fn, [builder.bitcast(pointer, i8p), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()
    return types.void(flat, i), codegen


@njit(cache=True, inline="always")
def _prefetch_row(flat, first, n):
    """Prefetch flat[first:first + n], line by line."""
    for e in range(first, first + n, 64 // flat.itemsize):
        _prefetch(flat, e)


@njit(cache=True, inline="always", fastmath=_FASTMATH, error_model="numpy")
def _softmax_step(s, r, seen, n, m, l):
    """One online-softmax step for row r of the scores s (n keys, the first
    `seen` visible to the row): s[r, :seen] becomes P = exp(S - new running
    max), s[r, seen:n] = 0 (keys in the row's future), the running max m[r] and
    sum l[r] are updated. Returns alpha = exp(old max - new max), by which the
    caller rescales what earlier steps accumulated (0 on the first step)."""
    m_new = m[r]
    for j in range(seen):
        m_new = max(m_new, s[r, j])
    a = np.exp(m[r] - m_new)
    l_r = l[r] * a
    for j in range(seen):
        p = _exp(s[r, j] - m_new)
        s[r, j] = p
        l_r += p
    for j in range(max(seen, 0), n):
        s[r, j] = 0.0  # the key lies in this row's future
    m[r] = m_new
    l[r] = l_r
    return a
