"""Attention over a paged KV cache: the readable PyTorch reference.

vLLM counterparts: `paged_attention_v1` (`csrc/attention/paged_attention_v1.cu`)
for decode, and the unified Triton kernel
(`vllm/attention/ops/triton_unified_attention.py`) / `flash_attn_varlen_func`
for any mix of decode, prefill and chunked prefill in one batch.

Invariants the code relies on (and the tests check):
- only the first ceil(seq_len / block_size) entries of a block-table row are
  read, so -1 padding after them is never used as an index;
- exactly seq_len positions are kept, so slots past seq_len (stale or NaN)
  never reach the softmax;
- the q_len queries of a sequence are its LAST q_len positions: query t sees
  keys 0 .. seq_len - q_len + t.
Arithmetic is float32; the output has the query's dtype. An fp8 cache is read
dequantised: float32(stored) * k_scale for keys, * v_scale for values (vLLM's
per-tensor scales); other caches take scale 1.0 only.
"""
from __future__ import annotations

import torch

from mini_vllm.kernels.kv_cache_dtype import dequantize, is_fp8

from .checks import check_cu_seqlens_q, check_paged_attention_args


def gather_kv(key_cache, value_cache, block_table_row, seq_len: int, k_scale=1.0, v_scale=1.0):
    """Contiguous K and V [seq_len, num_kv_heads, head_dim] of one sequence; an fp8
    cache's come back dequantised, in float32."""
    block_size = key_cache.shape[1]
    num_used = -(-seq_len // block_size)
    blocks = block_table_row[:num_used].long()  # never touches the -1 padding
    k = key_cache[blocks].flatten(0, 1)[:seq_len]  # [num_used*block_size, ...] -> seq_len
    v = value_cache[blocks].flatten(0, 1)[:seq_len]
    if is_fp8(key_cache.dtype):
        k, v = dequantize(k, float(k_scale)), dequantize(v, float(v_scale))
    return k, v


def _attend(q, k, v, scale: float):
    """Causal attention of q [q_len, H, D] (the last q_len positions) over
    k, v [seq_len, KVH, D], in float32."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads  # query head h reads KV head h // group
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def paged_attention_varlen(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                           k_scale=1.0, v_scale=1.0):
    """query [num_tokens, num_heads, head_dim]; sequence i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1]. Returns [num_tokens, num_heads, head_dim]."""
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs,
                               k_scale, v_scale)
    check_cu_seqlens_q(cu_seqlens_q, seq_lens, query.shape[0], key_cache.device)
    out = torch.empty_like(query)
    for i in range(num_seqs):
        start, end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k, v = gather_kv(key_cache, value_cache, block_tables[i], int(seq_lens[i]), k_scale, v_scale)
        out[start:end] = _attend(query[start:end], k, v, scale).to(query.dtype)
    return out


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale=1.0, v_scale=1.0):
    """One new token per sequence: query [num_seqs, num_heads, head_dim] is
    position seq_len - 1 and sees all seq_len cached positions."""
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) and query.dim() == 3 else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs,
                               k_scale, v_scale)
    out = torch.empty_like(query)
    for i in range(num_seqs):
        k, v = gather_kv(key_cache, value_cache, block_tables[i], int(seq_lens[i]), k_scale, v_scale)
        out[i] = _attend(query[i:i + 1], k, v, scale)[0].to(query.dtype)
    return out
