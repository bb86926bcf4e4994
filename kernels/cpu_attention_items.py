"""The two per-item loops of the CPU paged-attention kernel: a tile of a
prefill (`_attend_item`, BLAS products) and one decode token (`_decode_item`,
plain loops). Each runs in one thread on the item `cpu_paged_attention`'s
planner gave it, with that thread's own scratch arrays.

vLLM counterpart: the per-sequence loops of `csrc/cpu/cpu_attn_impl.hpp`.
The algorithm, the work split and the invariants are described in
`cpu_paged_attention.py`.
"""
from __future__ import annotations

import numpy as np

from .cpu_attention_math import (FMT_BF16, FMT_FP32, _FASTMATH, _NEG_INF, _bf16_to_fp32, _prefetch_row,
                                 _softmax_step, _widen_block, _widen_row)
from .cpu_numba import numba  # noqa: F401

from numba import njit  # noqa: E402


@njit(cache=True, fastmath=_FASTMATH, error_model="numpy")
def _attend_item(query, key_cache, value_cache, out, table_row, seq_len, q_start, q_len, t0, t1, kvh,
                 group, fmt, scale, step_keys, q_tile, acc, m, l, alpha, s_buf, pv_buf, k_tile, v_tile):
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
            _widen_block(key_cache, phys, kvh, keys, fmt, k_tile[c:])
            _widen_block(value_cache, phys, kvh, keys, fmt, v_tile[c:])
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
                 step_keys, q_rows, acc, m, l, s_buf, k_rows, v_rows):
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
                    if fmt == FMT_FP32:  # read in place
                        for r in range(r0, r0 + group):
                            x0, x1 = np.float32(0.0), np.float32(0.0)
                            for d in range(head_dim):
                                x0 += q_rows[r, d] * key_cache[phys, slot, kvh, d]
                                x1 += q_rows[r, d] * key_cache[phys, pair, kvh, d]
                            s[r, j], s[r, c + pair] = x0, x1
                    elif fmt == FMT_BF16:  # widened in the loop: a shift
                        for r in range(r0, r0 + group):
                            x0, x1 = np.float32(0.0), np.float32(0.0)
                            for d in range(head_dim):
                                x0 += q_rows[r, d] * _bf16_to_fp32(key_cache[phys, slot, kvh, d])
                                x1 += q_rows[r, d] * _bf16_to_fp32(key_cache[phys, pair, kvh, d])
                            s[r, j], s[r, c + pair] = x0, x1
                    else:  # fp16's widening is longer: once per row, for all the group's rows
                        _widen_row(key_cache, phys, slot, kvh, fmt, k_rows[0])
                        _widen_row(key_cache, phys, pair, kvh, fmt, k_rows[1])
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
                        _widen_row(value_cache, phys, slot, kvh, fmt, v_rows[0])
                        _widen_row(value_cache, phys, pair, kvh, fmt, v_rows[1])
                        for r in range(r0, r0 + group):
                            p0, p1 = s[r, j], s[r, c + pair] if pair > slot else np.float32(0.0)
                            for d in range(head_dim):
                                acc[r, d] += p0 * v_rows[0, d] + p1 * v_rows[1, d]
    for r in range(rows):
        inv = np.float32(1.0) / l[r]  # l >= 1: the row saw its own max
        for d in range(head_dim):
            out[tok, h0 * group + r, d] = acc[r, d] * inv
