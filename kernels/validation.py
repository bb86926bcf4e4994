"""Argument checks shared by the paged-attention reference (Chapter 1) and its
Triton kernels, so both reject bad input with the same clear message.

Every error is a ValueError that names the offending argument and says what
was expected.
"""
from __future__ import annotations

import torch

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What a KV cache may also hold: an fp8 format (`kv_cache_dtype.py`), read with its per-tensor scale.
KV_CACHE_DTYPES = CACHE_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on device {device}, got {t.device}")


def check_kv_cache(key_cache, value_cache) -> tuple[int, int, int, int]:
    """Caches are [num_blocks, block_size, num_kv_heads, head_dim], same shape,
    dtype and device. Returns that shape."""
    check_tensor("key_cache", key_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_tensor("value_cache", value_cache, ndim=4, dtypes=(key_cache.dtype,), device=key_cache.device)
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape {tuple(key_cache.shape)}"
        )
    return tuple(key_cache.shape)


def check_num_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query num_heads ({num_heads}) must be a multiple of the cache's num_kv_heads ({num_kv_heads})"
        )


def check_block_tables(block_tables, seq_lens, num_seqs: int, block_size: int, device) -> None:
    """block_tables [num_seqs, max_blocks] int32 and seq_lens [num_seqs] int32/int64,
    with every sequence fitting into its table row."""
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but there are {num_seqs} sequences")
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but there are {num_seqs} sequences")
    if num_seqs and int(seq_lens.min()) < 1:
        raise ValueError(f"seq_lens must be >= 1, got min {int(seq_lens.min())}")
    capacity = block_tables.shape[1] * block_size
    if num_seqs and int(seq_lens.max()) > capacity:
        raise ValueError(
            f"seq_lens max {int(seq_lens.max())} exceeds block_tables capacity "
            f"{block_tables.shape[1]} blocks x block_size {block_size} = {capacity}"
        )
