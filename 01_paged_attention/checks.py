"""Argument checks specific to Chapter 1 (the shared ones live in
`mini_vllm.kernels.validation`, used by both this reference and the kernels).

Every failure is a ValueError naming the argument and the allowed range.
"""
from __future__ import annotations

import math

import torch

from mini_vllm.kernels.validation import CACHE_DTYPES, check_tensor

INDEX_DTYPES = (torch.int32, torch.int64)


def check_query(query, key_cache, name: str = "query") -> None:
    """query [tokens, num_heads, head_dim] on the cache's device, head_dim matching."""
    check_tensor(name, query, ndim=3, dtypes=CACHE_DTYPES, device=key_cache.device)
    if query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"{name} head_dim {query.shape[2]} must equal the cache's head_dim {key_cache.shape[3]}")


def check_scale(scale) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")


def check_table_entries(block_tables, seq_lens, block_size: int, num_blocks: int) -> None:
    """The first ceil(seq_len / block_size) entries of each row must be real
    physical blocks in [0, num_blocks); only entries past them may be -1.
    (Indexing with -1 would silently wrap to the last block.)"""
    for i in range(block_tables.shape[0]):
        n = -(-int(seq_lens[i]) // block_size)
        used = block_tables[i, :n]
        if n and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(
                f"block_tables[{i}, :{n}] must hold physical block ids in [0, {num_blocks}) "
                f"for seq_len {int(seq_lens[i])}, got {used.tolist()}"
            )


def check_cu_seqlens_q(cu_seqlens_q, seq_lens, num_tokens: int, device) -> None:
    """int32 [num_seqs + 1], starting at 0, non-decreasing by at least 1 per
    sequence, ending at num_tokens, and q_len_i <= seq_len_i."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=device)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q must have num_seqs + 1 = {seq_lens.shape[0] + 1} entries, got {cu_seqlens_q.shape[0]}"
        )
    if int(cu_seqlens_q[0]) != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {int(cu_seqlens_q[0])}")
    if int(cu_seqlens_q[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens_q must end at query's num_tokens {num_tokens}, got {int(cu_seqlens_q[-1])}")
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    if q_lens.numel() and int(q_lens.min()) < 1:
        raise ValueError(f"cu_seqlens_q must increase by >= 1 per sequence (q_len >= 1), got {cu_seqlens_q.tolist()}")
    too_long = q_lens > seq_lens.to(torch.int64)
    if bool(too_long.any()):
        i = int(too_long.nonzero()[0])
        raise ValueError(
            f"cu_seqlens_q gives sequence {i} q_len {int(q_lens[i])} > seq_lens[{i}] {int(seq_lens[i])}: "
            "queries must be the last q_len of seq_len cached positions"
        )
