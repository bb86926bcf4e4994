"""Triton paged attention: decode and varlen (decode + prefill + chunks).

vLLM counterparts: `paged_attention_v1` (`csrc/attention/paged_attention_v1.cu`)
for decode, and the unified Triton kernel
(`vllm/attention/ops/triton_unified_attention.py`) for a ragged mix of decodes,
whole prefills, chunked prefills and prefills after a prefix-cache hit.
Same signatures and errors as the PyTorch reference in
`mini_vllm.paged_attention`.

One kernel body serves both entry points. A program owns one KV head of one
sequence and a tile of that sequence's queries; it stacks the query tile x
the whole query group of the KV head (GQA) into the M rows of a `tl.dot`, and
walks the sequence's keys in BLOCK_N-wide tiles with an online softmax
(running max, running sum, fp32 accumulator). A key tile may span several
cache blocks (block size 8 still feeds a 32-wide dot; tl.dot needs >= 16): each key position looks
up its own physical block in the block table.

Invariants: only key positions < seq_len are loaded (masked loads), so NaN or
stale data past seq_len, in unused blocks or behind -1 table entries is never
read; query t of a sequence sits at position seq_len - q_len + t and sees keys
0 .. that position; key 0 is visible to every row, so the first tile makes
the running max finite and later fully masked tiles add exp(-inf) = 0.
Arithmetic: fp32 softmax and accumulators. fp32 caches use IEEE fp32 dots
(no TF32); fp16/bf16 caches on a GPU feed their native dtype to the tensor
cores with fp32 accumulation (the fast path); under the interpreter everything
is cast to fp32 first, because it gets bf16 arithmetic wrong. An fp8 cache
(`kv_cache_dtype.py`) is dequantised on load, fp32(stored) * k_scale (v_scale
for values), then fed to the dot like a cache in the query's dtype.

Index tensors (block_tables, seq_lens, cu_seqlens_q) may be strided views;
the wrapper makes them contiguous (a copy only when they are not), because
the kernel reads them with unit element strides.

Host synchronisation: the launch itself needs none; both grids come from
tensor shapes (num_tokens, num_seqs, num_kv_heads), never from the values of
cu_seqlens_q or seq_lens. The argument checks do read small index tensors
back (a handful of vectorised reads per call, no per-sequence `.item()`).
"""
from __future__ import annotations

import torch

from .triton_setup import interpreting, require_triton_mode

require_triton_mode(__name__)  # before triton is first imported: see triton_setup.py

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .kv_cache_dtype import is_fp8
from .paged_checks import check_cu_seqlens_q, check_paged_attention_args

LOG2E = 1.4426950408889634
# Tile sizes: query rows per varlen tile, keys per inner step, warps. Picked
# by a sweep on an H100 (fp16, head_dim 128, GQA 4, 2048-token sequences):
# BLOCK_M 64-128 x BLOCK_N 32 x 4 warps was fastest for both decode and
# prefill; wider key tiles or 8 warps were 5-50% slower. Module-level so a
# benchmark or a test can change them.
VARLEN_BLOCK_M = 64
BLOCK_N = {"decode": 32, "varlen": 32}
NUM_WARPS = {"decode": 4, "varlen": 4}


@triton.jit
def _attend_key_range(
    q, q_pos, kv_start, kv_end, k_cache_ptr, v_cache_ptr, bt_row, kv_head, qk_scale_log2, k_scale, v_scale,
    kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, vc_s3,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, NATIVE_DOT: tl.constexpr, FP8: tl.constexpr,
):
    """The online softmax of the query rows `q` (row i at position q_pos[i]) over the keys
    kv_start .. kv_end - 1 of one KV head, read in BLOCK_N-wide tiles through the block table
    row `bt_row`: returns (running max in the log2 domain, running sum, unnormalised output).
    Shared by the paged kernel (one call over the visible range) and the split-KV kernel
    (one call per segment)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + n
        k_ok = pos < kv_end
        # Physical block of every key position; -1 entries sit past seq_len, never loaded.
        phys = tl.load(bt_row + pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        off = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = k_ok[None, :] & d_ok[:, None]
        k = tl.load(k_cache_ptr + phys[None, :] * kc_s0 + off[None, :] * kc_s1 + kv_head * kc_s2
                    + d[:, None] * kc_s3, mask=kv_mask, other=0.0)  # [HEAD_DIM_P, BLOCK_N]
        v = tl.load(v_cache_ptr + phys[:, None] * vc_s0 + off[:, None] * vc_s1 + kv_head * vc_s2
                    + d[None, :] * vc_s3, mask=kv_mask.T, other=0.0)  # [BLOCK_N, HEAD_DIM_P]
        if FP8:  # dequantise on load (vLLM's unified kernel does the same), then the query's dtype
            k = k.to(tl.float32) * k_scale
            v = v.to(tl.float32) * v_scale
            if NATIVE_DOT:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
        if NATIVE_DOT:
            s = tl.dot(q, k)
        else:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        s = s * qk_scale_log2  # log2 domain: exp2 is the cheap exponential
        visible = k_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if NATIVE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    num_seqs, qk_scale_log2, k_scale, v_scale,
    q_s0, q_s1, q_s2, o_s0, o_s1, o_s2,
    kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, vc_s3, bt_s0,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    DECODE: tl.constexpr, NATIVE_DOT: tl.constexpr, FP8: tl.constexpr,
):
    """Grid, decode: (num_seqs, num_kv_heads). One query per sequence, so a
    program is exactly one (sequence, KV head) pair and its GROUP query heads
    fill the M rows (padded to BLOCK_M >= 16).

    Grid, varlen: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads). Axis 0
    enumerates query tiles of BLOCK_Q tokens over the whole batch; sequence s
    owns tiles starting at cu_seqlens_q[s] // BLOCK_Q + s, which bounds the
    count by num_tokens // BLOCK_Q + num_seqs. That bound is known on the host
    without reading cu_seqlens_q back, long prefills get many programs (not
    one huge one), and a decode costs a single tile. A program finds its
    sequence by binary search over cu_seqlens_q; the few spare programs return.
    """
    kv_head = tl.program_id(1)
    if DECODE:
        seq = tl.program_id(0)
        q_start = seq
        q_len = 1
        q_tile = 0
    else:
        pid = tl.program_id(0)
        lo = 0
        hi = num_seqs
        while hi - lo > 1:  # last sequence whose first tile index is <= pid
            mid = (lo + hi) // 2
            first = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
            lo = tl.where(first <= pid, mid, lo)
            hi = tl.where(first <= pid, hi, mid)
        seq = lo
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        q_tile = pid - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        context_len = seq_len - q_len

        # Row r of the tile = query token r // GROUP_P, head r % GROUP_P of the group.
        r = tl.arange(0, BLOCK_M)
        t = q_tile * BLOCK_Q + r // GROUP_P
        head = kv_head * GROUP + r % GROUP_P
        row_ok = (r // GROUP_P < BLOCK_Q) & (t < q_len) & (r % GROUP_P < GROUP)
        q_pos = context_len + t
        d = tl.arange(0, HEAD_DIM_P)
        d_ok = d < HEAD_DIM
        tok = (q_start + t).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * q_s0 + head[:, None] * q_s1 + d[None, :] * q_s2,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if not NATIVE_DOT:
            q = q.to(tl.float32)

        # Causal: the tile's last query sees keys up to context_len + its index.
        kv_end = tl.minimum(seq_len, context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len))
        m_i, l_i, acc = _attend_key_range(
            q, q_pos, 0, kv_end, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * bt_s0, kv_head, qk_scale_log2,
            k_scale, v_scale, kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, vc_s3,
            BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P, NATIVE_DOT, FP8)
        # Every real row saw key 0, so l_i >= 1; the guard only spares padding rows.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * o_s0 + head[:, None] * o_s1 + d[None, :] * o_s2,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def native_dot(query) -> bool:
    """Feed the tensor cores the query's 16-bit dtype (a cache in that dtype, or an fp8
    cache dequantised to it); fp32 IEEE dots otherwise and always under the interpreter."""
    return query.dtype in (torch.float16, torch.bfloat16) and not interpreting()


def _launch(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale, decode,
            k_scale=1.0, v_scale=1.0):
    block_size, num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    group = query.shape[1] // num_kv_heads
    group_p = triton.next_power_of_2(group)
    if decode:
        block_q, block_m = 1, max(16, group_p)
        grid = (num_seqs, num_kv_heads)
    else:
        block_m = max(VARLEN_BLOCK_M, group_p)  # many query rows share each K/V load
        block_q = block_m // group_p
        grid = (query.shape[0] // block_q + num_seqs, num_kv_heads)
    # The kernel indexes these with unit strides (only block_tables' row stride
    # is passed); a strided view would be read as the wrong entries.
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    if cu_seqlens_q is not None:
        cu_seqlens_q = cu_seqlens_q.contiguous()
    kind = "decode" if decode else "varlen"
    block_n = max(BLOCK_N[kind], triton.next_power_of_2(block_size))
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, block_tables, seq_lens,
        cu_seqlens_q if cu_seqlens_q is not None else seq_lens,  # unused in decode
        num_seqs, float(scale) * LOG2E, float(k_scale), float(v_scale),
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        DECODE=decode, NATIVE_DOT=native_dot(query), FP8=is_fp8(key_cache.dtype), num_warps=NUM_WARPS[kind],
    )
    return out


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale=1.0, v_scale=1.0):
    """One new token per sequence: query [num_seqs, num_heads, head_dim] is
    position seq_len - 1 and sees all seq_len cached positions. Returns a
    tensor of query's shape and dtype."""
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) and query.dim() == 3 else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs,
                               k_scale, v_scale)
    return _launch(query, key_cache, value_cache, block_tables, seq_lens, None, scale, True, k_scale, v_scale)


def paged_attention_varlen(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                           k_scale=1.0, v_scale=1.0):
    """query [num_tokens, num_heads, head_dim]; sequence i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1], its last q_len_i positions, attended
    causally. Returns [num_tokens, num_heads, head_dim] in query's dtype."""
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs,
                               k_scale, v_scale)
    check_cu_seqlens_q(cu_seqlens_q, seq_lens, query.shape[0], key_cache.device)
    return _launch(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale, False,
                   k_scale, v_scale)


def paged_attention_unchecked(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                              decode: bool, k_scale: float = 1.0, v_scale: float = 1.0):
    """The launch alone, for a caller that validated the step's metadata once
    (the engine's `AttentionMetadata.validate`, run before the first layer):
    no host read-back, so the 28 layers of a step queue their kernels without
    waiting for the GPU, and the call can be captured in a CUDA graph.
    `decode=True` needs one query per sequence (cu_seqlens_q is then unused)."""
    return _launch(query, key_cache, value_cache, block_tables, seq_lens, None if decode else cu_seqlens_q,
                   scale, decode, k_scale, v_scale)
