"""Argument checks of the Chapter 1 kernels that `validation.py` does not hold.

They give the same messages as the PyTorch reference's checks
(`mini_vllm.paged_attention.checks`), so a learner sees one error whichever
implementation runs. They live here because kernels may not import from
chapters (imports flow kernels <- 01 <- 02 ...).

Cost: the data-dependent checks (block-table entries, cu_seqlens_q) read
small index tensors back to the host, one synchronisation each, vectorised
over the batch (no per-sequence `.item()`).
"""
from __future__ import annotations

import math

import torch

from .validation import CACHE_DTYPES, check_tensor

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
    """The first ceil(seq_len / block_size) entries of each row must be in
    [0, num_blocks); entries past them may be anything (-1) and are never read."""
    if block_tables.shape[0] == 0:
        return
    used_count = (seq_lens.to(torch.int64) + block_size - 1) // block_size
    col = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = col[None, :] < used_count[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        i = int(bad.any(dim=1).nonzero()[0])
        n = int(used_count[i])
        raise ValueError(
            f"block_tables[{i}, :{n}] must hold physical block ids in [0, {num_blocks}) "
            f"for seq_len {int(seq_lens[i])}, got {block_tables[i, :n].tolist()}"
        )


def check_cu_seqlens_q(cu_seqlens_q, seq_lens, num_tokens: int, device) -> None:
    """int32 [num_seqs + 1], starting at 0, rising by >= 1 per sequence, ending
    at num_tokens, with q_len_i <= seq_len_i."""
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
