"""Argument checks of Chapter 1's attention ops that `validation.py` does not hold.

The Triton kernels and the PyTorch reference (`mini_vllm.paged_attention`,
which re-exports them from its `checks.py`) share these, so a learner sees one
error whichever implementation runs. They live here because kernels may not
import from chapters (imports flow kernels <- 01 <- 02 ...).

Cost: the data-dependent checks (block-table entries, cu_seqlens_q) read the
small index tensors on the host (a device tensor is copied once, one
synchronisation each) and run vectorised in numpy over the batch (no
per-sequence `.item()`).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .kv_cache_dtype import check_kv_scale, is_fp8
from .validation import CACHE_DTYPES, check_block_tables, check_kv_cache, check_num_heads, check_tensor

INDEX_DTYPES = (torch.int32, torch.int64)


def check_query(query, key_cache, name: str = "query") -> None:
    """query [tokens, num_heads, head_dim] on the cache's device, in the cache's
    dtype (as vLLM's attention backends require: the fast path feeds both to
    one `tl.dot`, which rejects mixed dtypes), head_dim matching. An fp8 cache is
    read dequantised to fp32, so it takes a query of any of CACHE_DTYPES."""
    check_tensor(name, query, ndim=3, dtypes=CACHE_DTYPES, device=key_cache.device)
    if query.dtype != key_cache.dtype and not is_fp8(key_cache.dtype):
        raise ValueError(f"{name} dtype {str(query.dtype).replace('torch.', '')} must equal the cache's dtype "
                         f"{str(key_cache.dtype).replace('torch.', '')}")
    if query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"{name} head_dim {query.shape[2]} must equal the cache's head_dim {key_cache.shape[3]}")


def check_scale(scale) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")


def host_values(t: torch.Tensor) -> np.ndarray:
    """An index tensor's values as a numpy array: a view of a CPU tensor (no copy),
    one copy and one synchronisation for a device tensor. The checks below run in
    numpy, where an operation on a handful of values costs a microsecond, not the
    several a tensor operation costs on the host (the engine checks every step)."""
    return t.detach().cpu().numpy()


def check_slot_range(slot_mapping, num_slots: int) -> None:
    """Every slot is -1 (padding: nothing written) or a slot of the cache."""
    slots = host_values(slot_mapping)
    if slots.size and (slots.min() < -1 or slots.max() >= num_slots):
        raise ValueError(f"slot_mapping entries must be -1 (padding) or in [0, {num_slots}), got range "
                         f"[{int(slots.min())}, {int(slots.max())}]")


def check_table_entries(block_tables, seq_lens, block_size: int, num_blocks: int) -> None:
    """The first ceil(seq_len / block_size) entries of each row must be in
    [0, num_blocks); entries past them may be anything (-1) and are never read."""
    if block_tables.shape[0] == 0:
        return
    table, lens = host_values(block_tables), host_values(seq_lens).astype(np.int64)
    used_count = (lens + block_size - 1) // block_size
    used = np.arange(table.shape[1])[None, :] < used_count[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        i = int(np.flatnonzero(bad.any(axis=1))[0])
        n = int(used_count[i])
        raise ValueError(
            f"block_tables[{i}, :{n}] must hold physical block ids in [0, {num_blocks}) "
            f"for seq_len {int(lens[i])}, got {table[i, :n].tolist()}"
        )


def check_cu_seqlens_q(cu_seqlens_q, seq_lens, num_tokens: int, device) -> None:
    """int32 [num_seqs + 1], starting at 0, rising by >= 1 per sequence, ending
    at num_tokens, with q_len_i <= seq_len_i."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=device)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q must have num_seqs + 1 = {seq_lens.shape[0] + 1} entries, got {cu_seqlens_q.shape[0]}"
        )
    cu, lens = host_values(cu_seqlens_q).astype(np.int64), host_values(seq_lens).astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {int(cu[0])}")
    if cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_q must end at query's num_tokens {num_tokens}, got {int(cu[-1])}")
    q_lens = cu[1:] - cu[:-1]
    if q_lens.size and q_lens.min() < 1:
        raise ValueError(f"cu_seqlens_q must increase by >= 1 per sequence (q_len >= 1), got {cu.tolist()}")
    too_long = q_lens > lens
    if too_long.any():
        i = int(np.flatnonzero(too_long)[0])
        raise ValueError(
            f"cu_seqlens_q gives sequence {i} q_len {int(q_lens[i])} > seq_lens[{i}] {int(lens[i])}: "
            "queries must be the last q_len of seq_len cached positions"
        )


def check_kv_scales(k_scale, v_scale, key_cache) -> tuple[float, float]:
    """Per-tensor scales of a cache: finite and > 0; 1.0 unless the cache is fp8."""
    return check_kv_scale("k_scale", k_scale, key_cache.dtype), check_kv_scale("v_scale", v_scale, key_cache.dtype)


def check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    """Checks `reshape_and_cache`'s arguments; returns the cache geometry
    (num_blocks, block_size, num_kv_heads, head_dim). New K/V are in the cache's
    dtype, or for an fp8 cache in any of CACHE_DTYPES (quantized on the way in)."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(key_cache, value_cache)
    check_kv_scales(k_scale, v_scale, key_cache)
    dev = key_cache.device
    kv_dtypes = CACHE_DTYPES if is_fp8(key_cache.dtype) else (key_cache.dtype,)
    check_tensor("key", key, ndim=3, dtypes=kv_dtypes, device=dev)
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=dev)
    if key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key shape {tuple(key.shape)} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")
    check_slot_range(slot_mapping, num_blocks * block_size)
    return num_blocks, block_size, num_kv_heads, head_dim


def check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale,
                               num_seqs: int, k_scale=1.0, v_scale=1.0) -> None:
    """Checks the arguments shared by paged decode and varlen attention."""
    num_blocks, block_size, num_kv_heads, _ = check_kv_cache(key_cache, value_cache)
    check_kv_scales(k_scale, v_scale, key_cache)
    check_query(query, key_cache)
    check_num_heads(query.shape[1], num_kv_heads)
    check_block_tables(block_tables, seq_lens, num_seqs, block_size, key_cache.device)
    check_table_entries(block_tables, seq_lens, block_size, num_blocks)
    check_scale(scale)
