"""CPU paged attention compiled with numba: the engine's varlen batch, read in place.

vLLM counterparts: the CPU attention backend `vllm/v1/attention/backends/cpu_attn.py`
and its C++ kernels `csrc/cpu/cpu_attn.cpp` / `cpu_attn_impl.hpp`. Same signatures
and errors as Chapter 1's PyTorch reference (`mini_vllm.paged_attention`) and
the Triton kernels beside this file.

Why a compiled kernel on the CPU: the "torch" backend first copies every
sequence's blocks into a padded tensor, then reads that copy again in one
SDPA call. This kernel walks each sequence's block table and reads K/V rows
where they lie in the cache, once per query tile, with an online softmax
(running max, running sum, fp32 accumulator), as Chapter 1's lesson and the
Triton kernel do.

Work split: a prefill or chunk is one work item per (sequence, KV head, tile
of up to `TILE_ROWS // group` query tokens), so two cores share a long
prefill. A decode (q_len 1) is one item of all the KV heads of its sequence:
each cache block [block_size, num_kv_heads, head_dim] is then one contiguous
read, where an item per KV head would read head_dim-sized pieces with gaps
(the other heads' rows); with fewer decodes than `DECODE_ITEMS_PER_THREAD`
per thread, one item per (sequence, KV head) instead, so the threads still
share them. Items are sorted longest first and handed out one at a time
from a shared counter (`_take`), so ragged batches end balanced.

Two paths, both FlashAttention's loop: the sequence's keys are taken a step
at a time, several cache blocks per step (`KV_TILE_BYTES` of fp32 keys), and
per step

    S   = Q @ K_step.T                 scores, query rows x keys
    P   = exp(S - running max)         keys in a row's future get P = 0
    acc = acc * alpha + P @ V_step     alpha = exp(old max - new max)

- The tiled path (`_attend_item`: prefill tiles, and decodes whose group
  exceeds `DECODE_MAX_GROUP`) stacks an item's query tokens x the `group`
  query heads of its KV head into the rows of a query tile Q (up to 64 rows),
  widens each step's K/V blocks into fp32 tiles and does the two products as
  BLAS calls (numba compiles `np.dot` on float32 arrays to sgemm from scipy's
  OpenBLAS); the softmax between them is plain loops.
- The decode path (`_decode_item`) has one query row per query head, `group`
  per KV head: products that small cost more in BLAS call overhead (1-2 us a
  call) than in arithmetic. So S and P @ V are plain loops the compiler
  vectorises over head_dim, each K/V row read once, in place, for its group's
  rows, two keys at a time. Decode attention is memory-bound (each K/V
  element read serves `group` multiply-adds), and the blocks of a sequence
  lie at random places in the cache, where the hardware prefetcher cannot
  follow, so the loops prefetch the same slots one block ahead (`_prefetch`).
  Measurements and the variants tried: `kernels/NOTES.md`.

Invariants:
- only positions < seq_len are read (or prefetched): an item's last key is
  its last query's position, so -1 table entries, unused blocks and NaN slots
  past seq_len are never touched (a masked key's P is 0, but 0 * NaN would
  still be NaN);
- query t of a sequence sits at position seq_len - q_len + t and sees keys
  0 .. that position; key 0 is in the first step and visible to every row, so
  each row's running max is finite from the first step on;
- each query row's arithmetic is the same whichever item or thread computes
  it, so the thread count changes no bit of the output.

Arithmetic: fp32 scores, softmax and accumulators. fp32 caches are read as
they are; bf16 and fp16 caches as raw bits (uint16: numba has no bf16 or CPU
fp16 type), widened to fp32: bf16 by shifting its 16 bits into the top of an
fp32, fp16 by the exponent rebias below. exp of the scores is a polynomial
the compiler vectorises (`_exp`, relative error under 1e-7). The output is
fp32 and cast to the query's dtype by torch (round to nearest even).
fp8 caches (`kv_cache_dtype.py`: e4m3 or e5m2, per-tensor k_scale / v_scale)
are read as bytes, each widened by a 256-entry fp32 table of the format's
values times the scale (`fp8_table`): one load per element, the same fp32
product as Chapter 1's dequantising reference, for both formats alike.
`fastmath` allows only reassociation and fused multiply-add, so loops
vectorise while -inf and NaN keep IEEE meaning; numpy's error model makes a
division by zero give inf/NaN (as in torch) instead of raising from a thread.

fp32, bf16 and fp8 caches on a CPU with AVX512_BF16 or AVX2 + FMA + F16C (and
head_dim a multiple of 16 / 32; an fp8 cache with an fp32 or bf16 query and
`cpu_native.scales_ok` scales) run the C++ kernel of `cpu_native.py` /
`csrc/cpu_attn.cpp` instead, on the same plan of work items: its bf16 dot
products are one VDPBF16PS per 32 pairs (on AVX2, the pairs widened in
registers and two FMAs), its fp8 bytes widened by bit arithmetic, with the
accumulators held in registers across a block, which numba cannot arrange.
This file stays the kernel of every other case and the reference the C++
kernel's tests compare with.

Threads and BLAS: `cpu_runtime.py` (numba's pool sized to every CPU, started
passive on the first call, as many threads per call as torch uses; BLAS held
to one thread while the tiled path calls it).

One file on purpose: numba's disk cache checks only the timestamp of the
file that defines a cached function, not of the files its callees come
from, so loops split over several files would keep running stale machine
code after an edit to a callee (the mutants in `mutants/ch1.py` would
survive). `kernels/cpu_layer_ops.py` inlines `_exp` from here: after editing
`_exp`, delete `kernels/__pycache__` (or touch cpu_layer_ops.py).

Compile times and the on-disk cache: `kernels/NOTES.md`.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
from llvmlite import binding as llvm_binding, ir as llvm_ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import cpu_native
from .cpu_runtime import single_threaded_blas, use_torch_threads
from .kv_cache_dtype import fp8_table, is_fp8
from .paged_checks import check_cu_seqlens_q, check_paged_attention_args, check_query
from .validation import check_kv_cache, check_num_heads

# At most this many threads per kernel call (also at most torch's count); None: no cap.
# Tests set it to check that a split between threads changes no bit.
KERNEL_THREADS: int | None = None
FMT_FP32, FMT_BF16, FMT_FP16, FMT_FP8 = 0, 1, 2, 3
_FORMATS = {torch.float32: FMT_FP32, torch.bfloat16: FMT_BF16, torch.float16: FMT_FP16,
            torch.float8_e4m3fn: FMT_FP8, torch.float8_e5m2: FMT_FP8}
_NO_TABLE = np.zeros(1, np.float32)  # the table argument of a cache that is not fp8 (never read)
# Query rows (tokens x heads of a group) per work item: 64 rows x head_dim 128
# of fp32 accumulators is 32 KiB. Measured against 32, 128 and 256 rows: 64 is
# as fast as any on prefills of 64-512 tokens (128 and 256 lose up to 25% on
# short prefills, whose last tile is mostly empty).
TILE_ROWS = 64
# Keys per softmax step: as many as fill a 32 KiB fp32 tile (128 keys at
# head_dim 64, 64 at 128), rounded down to whole cache blocks: larger matrix
# products and fewer rescales than one 16-key block per step, 10% faster on a
# 512-token prefill (20.1 -> 18.1 ms at head_dim 128); 64 KiB tiles measured
# within 8% either way.
KV_TILE_BYTES = 32 << 10
# A decode item (one query token) covers all KV heads of its sequence, so each
# cache block is one contiguous read, unless the batch has fewer decodes than
# this many per thread: then one item per (sequence, KV head), so the threads
# still share the work. Per sequence against per (sequence, KV head), one
# thread: 16 Qwen3 decodes (8 KV heads) 4.3 against 7.3 ms, 128 decodes of the
# engine's shape (2 KV heads) 3.8 against 6.3 ms.
DECODE_ITEMS_PER_THREAD = 4
# Decodes with more query heads per KV head than this take the tiled (BLAS)
# path: at 16, sgemm's register blocking beats the decode loops (heads 32/2
# d64: 8.1 ms tiled, 8.4 ms decode path); at 8 the decode path is faster (heads
# 16/2 d64: 4.9 ms against 6.1 ms).
DECODE_MAX_GROUP = 8
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
def _widen_row(cache, phys, slot, kvh, fmt, row, table):
    """row[:] = the head_dim values of KV head kvh at slot `slot` of physical
    block phys, as fp32 (an fp8 byte b: table[b], its value times the scale).
    The format branch sits outside the loops so each loop vectorises."""
    head_dim = row.shape[0]
    if fmt == FMT_FP32:
        for d in range(head_dim):
            row[d] = cache[phys, slot, kvh, d]
    elif fmt == FMT_BF16:
        for d in range(head_dim):
            row[d] = _bf16_to_fp32(cache[phys, slot, kvh, d])
    elif fmt == FMT_FP8:
        for d in range(head_dim):
            # np.int32(...): numba types this branch for every cache (an fp32 one too), and a
            # float cannot index; for the uint8 bytes it is a zero extension.
            row[d] = table[np.int32(cache[phys, slot, kvh, d])]
    else:
        for d in range(head_dim):
            row[d] = _fp16_to_fp32(cache[phys, slot, kvh, d])


@njit(cache=True)
def _widen_block(cache, phys, kvh, n, fmt, tile, table):
    """tile[:n] = slots 0..n-1 of KV head kvh in physical block phys, as fp32."""
    for j in range(n):
        _widen_row(cache, phys, j, kvh, fmt, tile[j], table)


# llvm.prefetch's name carries its pointer type: "p0" once LLVM's pointers are opaque (LLVM 15+).
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


@njit(cache=True, fastmath=_FASTMATH, error_model="numpy")
def _attend_item(query, key_cache, value_cache, out, table_row, seq_len, q_start, q_len, t0, t1, kvh,
                 group, fmt, scale, step_keys, q_tile, acc, m, l, alpha, s_buf, pv_buf, k_tile, v_tile,
                 k_table, v_table):
    """Query tokens t0..t1-1 of one sequence x the group of KV head kvh, over
    the sequence's keys, step_keys at a time, with an online softmax. Scratch
    arrays are the calling thread's own."""
    head_dim = query.shape[2]
    block_size = key_cache.shape[1]
    context_len = seq_len - q_len  # query t sits at position context_len + t
    rows = (t1 - t0) * group
    for r in range(rows):  # row r = token t0 + r // group, head kvh * group + r % group
        tok, head = q_start + t0 + r // group, kvh * group + r % group
        for d in range(head_dim):
            q_tile[r, d] = query[tok, head, d] * scale
            acc[r, d] = 0.0
        m[r] = _NEG_INF
        l[r] = 0.0
    q = q_tile[:rows]
    # np.dot(a, b, out) needs a contiguous out of the exact shape: views of flat buffers.
    pv = pv_buf[:rows * head_dim].reshape((rows, head_dim))
    kv_end = context_len + t1  # the item's last query sees keys up to context_len + t1 - 1
    for start in range(0, kv_end, step_keys):
        n = min(step_keys, kv_end - start)  # never a slot at or past kv_end <= seq_len
        for c in range(0, n, block_size):  # step_keys is a multiple of block_size
            phys = table_row[(start + c) // block_size]
            keys = min(block_size, n - c)
            _widen_block(key_cache, phys, kvh, keys, fmt, k_tile[c:], k_table)
            _widen_block(value_cache, phys, kvh, keys, fmt, v_tile[c:], v_table)
        # All rows x all keys of the step in one sgemm instead of a dot-product
        # loop per (row, key), and P @ V below: with np.exp, 1.9x on a 512-token
        # prefill at head_dim 128 (44 -> 23 ms), a few % on decodes.
        s = s_buf[:rows * n].reshape((rows, n))
        np.dot(q, k_tile[:n].T, s)
        for r in range(rows):
            seen = min(n, context_len + t0 + r // group - start + 1)  # causal: the row sees keys 0..seen-1
            alpha[r] = _softmax_step(s, r, seen, n, m, l)
        # P @ V as a second sgemm instead of acc[r] += p * v per (row, key),
        # then the rescale and the sum in one pass over acc. A masked key adds
        # 0 * v: v must be a real key's value, never a NaN slot past seq_len
        # (0 * NaN = NaN), hence n stops at kv_end.
        np.dot(s, v_tile[:n], pv)
        for r in range(rows):
            for d in range(head_dim):
                acc[r, d] = acc[r, d] * alpha[r] + pv[r, d]
    for r in range(rows):
        tok, head = q_start + t0 + r // group, kvh * group + r % group
        inv = np.float32(1.0) / l[r]  # l >= 1: every row saw key 0 and its own max
        for d in range(head_dim):
            out[tok, head, d] = acc[r, d] * inv


@njit(cache=True, fastmath=_FASTMATH, error_model="numpy")
def _decode_item(query, key_cache, value_cache, out, table_row, seq_len, q_len, tok, h0, h1, group, fmt, scale,
                 step_keys, q_rows, acc, m, l, s_buf, k_rows, v_rows, k_table, v_table):
    """The one query token `tok` of a sequence (a decode) x the query heads of
    KV heads h0..h1-1, over the sequence's keys, step_keys at a time, with the
    online softmax of `_attend_item`. Plain loops instead of BLAS: a decode
    has `group` query rows per KV head, and products that small cost more in
    call overhead than in arithmetic. Scratch arrays are the calling thread's
    own; k_rows and v_rows hold two fp16 rows widened to fp32."""
    head_dim = query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    kv_end = seq_len - q_len + 1  # the token sits at position seq_len - q_len and sees keys 0..that position
    rows = (h1 - h0) * group  # row r: query head h0 * group + r, whose KV head is h0 + r // group
    for r in range(rows):
        for d in range(head_dim):
            q_rows[r, d] = query[tok, h0 * group + r, d] * scale
            acc[r, d] = 0.0
        m[r] = _NEG_INF
        l[r] = 0.0
    # Flat views of the caches, for the prefetches: the row of slot `slot` of
    # block b (all KV heads) starts at (b * block_size + slot) * row_len.
    k_flat, v_flat = key_cache.reshape(-1), value_cache.reshape(-1)
    row_len = num_kv_heads * head_dim
    for start in range(0, kv_end, step_keys):
        keys = min(step_keys, kv_end - start)  # stops at kv_end <= seq_len: no slot past it is read
        s = s_buf[:rows * keys].reshape((rows, keys))
        # S = Q K^T. Each K row is read once, for the `group` query rows of its
        # KV head, and two keys at a time, so each element of q is loaded once
        # for both (128 decodes of 16-768 tokens, heads 4/2 d64, block 32, L3
        # evicted: 4.3 -> 3.8 ms; K/V in L2: 16 -> 13 ns per key and query
        # head). An odd last key of a block is paired with itself.
        # Meanwhile the same slots one block ahead are prefetched (for V too,
        # below): blocks lie at random places in the cache, where the hardware
        # prefetcher, which extrapolates addresses, cannot follow. On those 128
        # decodes: 6.9 ms without, 4.3 ms with (the copy-bandwidth floor: 4.2 ms).
        for c in range(0, keys, block_size):  # step_keys is a multiple of block_size
            blk = (start + c) // block_size
            phys = table_row[blk]  # the block's physical id, from the table
            n = min(block_size, keys - c)
            for slot in range(0, n, 2):
                j, pair = c + slot, min(slot + 1, n - 1)  # the two keys: slots slot and pair of the block
                ahead = max(0, min(2, kv_end - (start + j + block_size)))  # keys one block ahead, to prefetch
                at = (table_row[blk + 1] * block_size + slot) * row_len if ahead else 0  # where they start in k_flat
                for kvh in range(h0, h1):
                    if ahead > 0:  # two ifs, not a loop over `ahead`: 15% faster
                        _prefetch_row(k_flat, at + kvh * head_dim, head_dim)
                    if ahead > 1:
                        _prefetch_row(k_flat, at + row_len + kvh * head_dim, head_dim)
                    r0 = (kvh - h0) * group  # the query rows of KV head kvh: r0 .. r0 + group - 1
                    # Two query rows per pass where the group has them (the last row of an
                    # odd group alone): each K element is loaded (and widened) once for
                    # four products instead of two. Which pass a row takes is fixed by its
                    # place in the group, so its bits still depend on no batch or thread.
                    if fmt == FMT_FP32:  # read in place
                        for r in range(r0, r0 + group, 2):
                            x0, x1, y0, y1 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
                            if r + 1 < r0 + group:
                                for d in range(head_dim):
                                    k0, k1 = key_cache[phys, slot, kvh, d], key_cache[phys, pair, kvh, d]
                                    x0 += q_rows[r, d] * k0
                                    x1 += q_rows[r, d] * k1
                                    y0 += q_rows[r + 1, d] * k0
                                    y1 += q_rows[r + 1, d] * k1
                                s[r + 1, j], s[r + 1, c + pair] = y0, y1
                            else:
                                for d in range(head_dim):
                                    x0 += q_rows[r, d] * key_cache[phys, slot, kvh, d]
                                    x1 += q_rows[r, d] * key_cache[phys, pair, kvh, d]
                            s[r, j], s[r, c + pair] = x0, x1
                    elif fmt == FMT_BF16:  # widened in the loop: a shift
                        for r in range(r0, r0 + group, 2):
                            x0, x1, y0, y1 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
                            if r + 1 < r0 + group:
                                for d in range(head_dim):
                                    k0 = _bf16_to_fp32(key_cache[phys, slot, kvh, d])
                                    k1 = _bf16_to_fp32(key_cache[phys, pair, kvh, d])
                                    x0 += q_rows[r, d] * k0
                                    x1 += q_rows[r, d] * k1
                                    y0 += q_rows[r + 1, d] * k0
                                    y1 += q_rows[r + 1, d] * k1
                                s[r + 1, j], s[r + 1, c + pair] = y0, y1
                            else:
                                for d in range(head_dim):
                                    x0 += q_rows[r, d] * _bf16_to_fp32(key_cache[phys, slot, kvh, d])
                                    x1 += q_rows[r, d] * _bf16_to_fp32(key_cache[phys, pair, kvh, d])
                            s[r, j], s[r, c + pair] = x0, x1
                    else:  # fp16's and fp8's widening is longer: once per row, for all the group's rows
                        _widen_row(key_cache, phys, slot, kvh, fmt, k_rows[0], k_table)
                        _widen_row(key_cache, phys, pair, kvh, fmt, k_rows[1], k_table)
                        for r in range(r0, r0 + group):
                            x0, x1 = np.float32(0.0), np.float32(0.0)
                            for d in range(head_dim):
                                x0 += q_rows[r, d] * k_rows[0, d]
                                x1 += q_rows[r, d] * k_rows[1, d]
                            s[r, j], s[r, c + pair] = x0, x1
        # The softmax step; what earlier steps accumulated is rescaled by alpha.
        for r in range(rows):
            a = _softmax_step(s, r, keys, keys, m, l)
            for d in range(head_dim):
                acc[r, d] *= a
        # acc += P V, two keys at a time (acc is loaded and stored once for both).
        # An odd last key paired with itself is added once: its second weight is 0.
        for c in range(0, keys, block_size):
            blk = (start + c) // block_size
            phys = table_row[blk]
            n = min(block_size, keys - c)
            for slot in range(0, n, 2):
                j, pair = c + slot, min(slot + 1, n - 1)
                ahead = max(0, min(2, kv_end - (start + j + block_size)))
                at = (table_row[blk + 1] * block_size + slot) * row_len if ahead else 0
                for kvh in range(h0, h1):
                    if ahead > 0:
                        _prefetch_row(v_flat, at + kvh * head_dim, head_dim)
                    if ahead > 1:
                        _prefetch_row(v_flat, at + row_len + kvh * head_dim, head_dim)
                    r0 = (kvh - h0) * group
                    if fmt == FMT_FP32:
                        for r in range(r0, r0 + group):
                            p0, p1 = s[r, j], s[r, c + pair] if pair > slot else np.float32(0.0)
                            for d in range(head_dim):
                                acc[r, d] += p0 * value_cache[phys, slot, kvh, d] + p1 * value_cache[phys, pair, kvh, d]
                    elif fmt == FMT_BF16:
                        for r in range(r0, r0 + group):
                            p0, p1 = s[r, j], s[r, c + pair] if pair > slot else np.float32(0.0)
                            for d in range(head_dim):
                                acc[r, d] += (p0 * _bf16_to_fp32(value_cache[phys, slot, kvh, d])
                                              + p1 * _bf16_to_fp32(value_cache[phys, pair, kvh, d]))
                    else:
                        _widen_row(value_cache, phys, slot, kvh, fmt, v_rows[0], v_table)
                        _widen_row(value_cache, phys, pair, kvh, fmt, v_rows[1], v_table)
                        for r in range(r0, r0 + group):
                            p0, p1 = s[r, j], s[r, c + pair] if pair > slot else np.float32(0.0)
                            for d in range(head_dim):
                                acc[r, d] += p0 * v_rows[0, d] + p1 * v_rows[1, d]
    for r in range(rows):
        inv = np.float32(1.0) / l[r]  # l >= 1: the row saw its own max
        for d in range(head_dim):
            out[tok, h0 * group + r, d] = acc[r, d] * inv


@njit(cache=True)
def _plan(cu_seqlens_q, seq_lens, tile_tokens, num_kv_heads, decode_path, threads, items_per_thread):
    """plan_items' work items in batch order, each with its cost (query rows x
    keys read, over group), and the KV heads per decode item. Compiled: numpy
    took 21 us for this on a small mixed batch (30 array operations of under
    a microsecond each), a cost paid per layer and step."""
    num_seqs = seq_lens.shape[0]
    num_decodes = 0
    for i in range(num_seqs):
        num_decodes += cu_seqlens_q[i + 1] - cu_seqlens_q[i] == 1
    decode_heads = 0  # no decode items
    if decode_path:
        decode_heads = num_kv_heads
        if num_decodes < items_per_thread * threads and threads > 1:
            # too few decodes to share: each split into about `threads` items of whole KV heads
            # (a divisor of num_kv_heads), which still read a contiguous run of each slot
            decode_heads = max(1, num_kv_heads // threads)
            while num_kv_heads % decode_heads:
                decode_heads -= 1
    count = 0
    for i in range(num_seqs):
        q_len = cu_seqlens_q[i + 1] - cu_seqlens_q[i]
        if q_len == 1 and decode_heads > 0:
            count += num_kv_heads // decode_heads
        else:
            count += (q_len + tile_tokens - 1) // tile_tokens * num_kv_heads
    item_seq, item_t0, item_h0 = np.empty(count, np.int64), np.empty(count, np.int64), np.empty(count, np.int64)
    cost = np.empty(count, np.int64)
    k = 0
    for i in range(num_seqs):
        q_len = cu_seqlens_q[i + 1] - cu_seqlens_q[i]
        if q_len == 1 and decode_heads > 0:  # KV heads h0 .. h0 + decode_heads - 1 of the one token
            for h0 in range(0, num_kv_heads, decode_heads):
                item_seq[k], item_t0[k], item_h0[k], cost[k] = i, 0, h0, decode_heads * seq_lens[i]
                k += 1
        else:  # a query tile x one KV head
            for t0 in range(0, q_len, tile_tokens):
                t1 = min(t0 + tile_tokens, q_len)
                for h0 in range(num_kv_heads):
                    item_seq[k], item_t0[k], item_h0[k] = i, t0, h0
                    cost[k] = (t1 - t0) * (seq_lens[i] - q_len + t1)
                    k += 1
    return item_seq, item_t0, item_h0, cost, decode_heads


def plan_items(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, tile_tokens: int, num_kv_heads: int, group: int,
               threads: int):
    """Work items (sequence, first query token, first KV head), longest first,
    and the number of KV heads a decode item covers (0: no decode items).
    With items handed out one at a time, the last to start are the short
    ones and the threads finish together. A sequence of q_len 1 (a decode) is
    one item of all its KV heads, or, when there are too few decodes to share
    among the threads (DECODE_ITEMS_PER_THREAD), about one item per thread of
    num_kv_heads // threads heads each (rounded down to a divisor); any other
    sequence, and any decode whose group exceeds DECODE_MAX_GROUP, is one
    item per (query tile, KV head). The sort is numpy's: a compiled argsort
    would add seconds to the first call."""
    item_seq, item_t0, item_h0, cost, decode_heads = _plan(
        cu_seqlens_q, seq_lens, tile_tokens, num_kv_heads, group <= DECODE_MAX_GROUP, threads, DECODE_ITEMS_PER_THREAD)
    order = np.argsort(-cost, kind="stable")
    return item_seq[order], item_t0[order], item_h0[order], decode_heads


@intrinsic
def _take(typingctx, counter):
    """Atomically add 1 to counter[0] and return its old value: the next work
    item's index, never the same for two threads. numba has no atomics of its
    own, so this emits LLVM's `atomicrmw add` (x86 `lock xadd`)."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        one = llvm_ir.Constant(llvm_ir.IntType(64), 1)
        return builder.atomic_rmw("add", array.data, one, "monotonic")
    return types.int64(counter), codegen


@njit(cache=True, parallel=True)
def _varlen_kernel(query, key_cache, value_cache, out, block_tables, cu_seqlens_q, seq_lens, item_seq, item_t0,
                   item_h0, tile_tokens, decode_heads, fmt, scale, step_keys, counter, q_tile, acc, m, l, alpha, s_buf,
                   pv_buf, k_tile, v_tile, k_table, v_table):
    """One prange iteration per thread (scratch slice w); each takes the next
    unstarted item from the shared counter until none is left. A decode takes
    the BLAS-free path, any other item the tiled one.
    Why not a prange over the items: numba's OpenMP layer gives each thread
    one equal slice of a prange, whatever `set_parallel_chunksize` says, so the
    thread with the first half of a longest-first list did most of the work
    (2 threads: a 2,048-token prefill 1.34x faster than 1 thread; 1.9x with the
    counter)."""
    group = query.shape[1] // key_cache.shape[2]
    num_items = item_seq.shape[0]
    for w in prange(q_tile.shape[0]):
        it = _take(counter)
        while it < num_items:
            i, t0, h0 = item_seq[it], item_t0[it], item_h0[it]
            q_start = cu_seqlens_q[i]
            q_len = cu_seqlens_q[i + 1] - q_start
            if q_len == 1 and decode_heads > 0:
                _decode_item(query, key_cache, value_cache, out, block_tables[i], seq_lens[i], q_len, q_start, h0,
                             h0 + decode_heads, group, fmt, scale, step_keys, q_tile[w], acc[w], m[w], l[w],
                             s_buf[w], k_tile[w, :2], v_tile[w, :2], k_table, v_table)
            else:
                _attend_item(query, key_cache, value_cache, out, block_tables[i], seq_lens[i], q_start, q_len,
                             t0, min(t0 + tile_tokens, q_len), h0, group, fmt, scale, step_keys, q_tile[w], acc[w],
                             m[w], l[w], alpha[w], s_buf[w], pv_buf[w], k_tile[w], v_tile[w], k_table, v_table)
            it = _take(counter)


def _cache_bits(cache: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of the cache: float32 as it is, bf16 and fp16 as
    their raw 16 bits (uint16; numpy has no bf16), fp8 as its bytes (uint8)."""
    if cache.dtype == torch.float32:
        return cache.numpy()
    if is_fp8(cache.dtype):
        return cache.view(torch.uint8).numpy()
    return cache.view(torch.int16).numpy().view(np.uint16)


def check_cpu_inputs(query, key_cache, value_cache) -> None:
    """The per-call checks, none of which reads tensor data: shapes and dtypes
    (as Chapter 1's checks), CPU tensors, contiguous caches."""
    _, _, num_kv_heads, _ = check_kv_cache(key_cache, value_cache)
    check_query(query, key_cache)
    check_num_heads(query.shape[1], num_kv_heads)
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU for the cpu kernel, got {t.device}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not t.is_contiguous():  # read in place: copying the whole cache per call would defeat the kernel
            raise ValueError(f"{name} must be contiguous for the cpu kernel, got strides {t.stride()}")


def batch_plan(num_heads: int, num_kv_heads: int, block_tables, cu_seqlens_q, seq_lens,
               plan_cache: dict | None = None):
    """(tile_tokens, threads, plan) of a batch: the plan is (cu, seq_lens, tables as numpy,
    item_seq, item_t0, item_h0, decode_heads), kept in `plan_cache` (one dict per batch)
    under the tiling and thread count it was made for."""
    group = num_heads // num_kv_heads
    tile_tokens = max(1, TILE_ROWS // group)
    # As many threads as torch uses (see "Threads"): 128 decodes of the throughput
    # workload, 2 threads, 3.7 ms on one thread, 2.9 ms on two.
    nthreads = use_torch_threads(KERNEL_THREADS)
    key = (tile_tokens, num_kv_heads, group, nthreads)
    plan = plan_cache.get(key) if plan_cache is not None else None
    if plan is None:
        cu = cu_seqlens_q.contiguous().numpy()
        seq_np = seq_lens.to(torch.int32).contiguous().numpy()
        plan = (cu, seq_np, block_tables.contiguous().numpy(),
                *plan_items(cu, seq_np, tile_tokens, num_kv_heads, group, nthreads))
        if plan_cache is not None:
            plan_cache[key] = plan
    return tile_tokens, nthreads, plan


def run_varlen(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
               plan_cache: dict | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The kernel without argument checks, for callers that checked once per
    step (the engine's AttentionMetadata.validate). Same result as
    `paged_attention_varlen`. `plan_cache`: a dict the caller keeps for one
    batch (the engine: one per step, shared by every layer), in which the
    batch's plan and numpy views are kept, so that layers 2..L skip building
    them (about 80 us a call for 128 decodes). An fp8 cache takes the C++ kernel
    where `cpu_native.handles` it and `scales_ok` its scales, else the numba kernel."""
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return torch.empty_like(query)
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    step_keys = block_size * max(1, KV_TILE_BYTES // (4 * head_dim) // block_size)
    tile_tokens, nthreads, plan = batch_plan(num_heads, num_kv_heads, block_tables, cu_seqlens_q, seq_lens,
                                             plan_cache)
    cu, seq_lens, tables, item_seq, item_t0, item_h0, decode_heads = plan
    if (cpu_native.handles(key_cache.dtype, head_dim, query.dtype)
            and (not is_fp8(key_cache.dtype) or cpu_native.scales_ok(k_scale, v_scale))):
        out = torch.empty_like(query)  # the C++ kernel (cpu_native.py), same items
        cpu_native.run(query.detach().contiguous(), key_cache, value_cache, out, tables, cu, seq_lens, item_seq,
                       item_t0, item_h0, tile_tokens, decode_heads, scale, nthreads, k_scale, v_scale)
        return out
    # Per-thread scratch, allocated once per call (not once per item, inside the
    # loop): about 2 us of the call's fixed 25 us, so not cached across calls.
    # A decode item has decode_heads * group rows, a tile tile_tokens * group.
    rows = max(tile_tokens, decode_heads) * group
    f32 = np.float32
    scratch = (np.empty((nthreads, rows, head_dim), f32), np.empty((nthreads, rows, head_dim), f32),  # Q, acc
               np.empty((nthreads, rows), f32), np.empty((nthreads, rows), f32),  # running max, running sum
               np.empty((nthreads, rows), f32),  # alpha, each row's rescale in this step
               np.empty((nthreads, rows * step_keys), f32), np.empty((nthreads, rows * head_dim), f32),  # S/P, P @ V
               np.empty((nthreads, step_keys, head_dim), f32), np.empty((nthreads, step_keys, head_dim), f32))  # K, V
    fp32 = query.dtype == torch.float32
    out = torch.empty_like(query) if fp32 else torch.empty(query.shape, dtype=torch.float32)
    counter = np.zeros(1, np.int64)  # the next item to hand out (_take)
    # Only the tiled path calls BLAS: a batch of decode items skips holding it to one thread.
    no_blas = num_tokens == seq_lens.shape[0] and decode_heads > 0
    with contextlib.nullcontext() if no_blas else single_threaded_blas():
        _varlen_kernel(query.detach().float().contiguous().numpy(), _cache_bits(key_cache),
                       _cache_bits(value_cache), out.numpy(), tables, cu, seq_lens,
                       item_seq, item_t0, item_h0, tile_tokens, decode_heads, _FORMATS[key_cache.dtype], f32(scale),
                       step_keys, counter, *scratch, *_tables(key_cache.dtype, k_scale, v_scale))
    return out if fp32 else out.to(query.dtype)


def _tables(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's (k_table, v_table): fp8 byte -> value * scale, or unused placeholders."""
    if not is_fp8(cache_dtype):
        return _NO_TABLE, _NO_TABLE
    return fp8_table(cache_dtype, float(k_scale)).numpy(), fp8_table(cache_dtype, float(v_scale)).numpy()


def paged_attention_varlen(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                           k_scale=1.0, v_scale=1.0):
    """query [num_tokens, num_heads, head_dim]; sequence i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1], its last q_len_i positions, attended
    causally. Returns [num_tokens, num_heads, head_dim] in query's dtype."""
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs,
                               k_scale, v_scale)
    check_cu_seqlens_q(cu_seqlens_q, seq_lens, query.shape[0], key_cache.device)
    check_cpu_inputs(query, key_cache, value_cache)
    return run_varlen(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                      k_scale=float(k_scale), v_scale=float(v_scale))


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale=1.0, v_scale=1.0):
    """One new token per sequence: query [num_seqs, num_heads, head_dim] is
    position seq_len - 1 and sees all seq_len cached positions."""
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) and query.dim() == 3 else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs,
                               k_scale, v_scale)
    check_cpu_inputs(query, key_cache, value_cache)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)  # a decode is a varlen batch of q_len 1
    return run_varlen(query, key_cache, value_cache, block_tables, cu, seq_lens, scale,
                      k_scale=float(k_scale), v_scale=float(v_scale))
