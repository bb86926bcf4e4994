"""Chapter 1 exercise: write the functions that make a KV cache *paged*.

Run the tests against this file with

    .venv/bin/pytest -q tests/test_ch1_*.py --impl=exercise

Start with `tests/test_ch1_examples.py`: each small case there names the
mistake it catches (off-by-one slot, GQA head mapping, causal offset, reading
past seq_len, -1 padding). The allocator and the cache allocation are given
(`kv_cache.py`), and so are the argument checks of attention and
`reshape_and_cache` (`checks.py`); the functions below are yours.

Shapes and dtypes the tests use:
- caches [num_blocks, block_size, num_kv_heads, head_dim], float32/float16/bfloat16;
- block_tables [num_seqs, max_blocks] int32; a row holds the physical block of
  each logical block, then -1 padding that must never be used as an index
  (as an index, -1 is the LAST block, which belongs to someone else);
- seq_lens [num_seqs] int32: positions 0..seq_len-1 of a sequence are cached;
- slot_mapping [num_tokens] int64 (int32 accepted as input); -1 marks padding.
"""
from __future__ import annotations

import torch

from mini_vllm.kernels.validation import check_tensor  # noqa: F401  (for your compute_slot_mapping)

from .checks import INDEX_DTYPES, check_cu_seqlens_q, check_paged_attention_args, check_reshape_and_cache_args  # noqa: F401
from .kv_cache import BlockAllocator, NoFreeBlocksError, allocate_kv_cache  # noqa: F401  (given)


def compute_slot_mapping(block_tables, req_indices, positions, block_size: int) -> torch.Tensor:
    """int64 [num_tokens]: where token (req_indices[t], positions[t]) lives in
    the cache viewed as a flat array of num_blocks * block_size slots.

    Raise ValueError, naming the argument in the message, when:
    - block_tables is not a 2-D int32 tensor ("block_tables");
    - req_indices / positions are not 1-D int32/int64 on block_tables' device,
      or their shapes differ ("req_indices", "positions");
    - block_size is not an int >= 1 ("block_size");
    - a req_indices entry is outside [0, num_reqs) ("req_indices");
    - a position is outside [0, max_blocks * block_size) ("positions");
    - a token's table entry is -1, i.e. its block was never allocated ("block_tables").
    Zero tokens give an empty int64 tensor.
    """
    raise NotImplementedError(
        "compute_slot_mapping: validate as the docstring lists (check_tensor(name, t, ndim=..., dtypes=..., "
        "device=...) from mini_vllm.kernels.validation does the tensor checks), then look up the physical block "
        "block_tables[req, pos // block_size] and add the offset pos % block_size: "
        "slot = block * block_size + offset. Index with int64 copies (.long()) and return int64."
    )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the caches
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping, in place."""
    # Given: raises ValueError naming key / value / key_cache / value_cache / slot_mapping
    # (dtype, shape, device, slot outside [-1, num_blocks * block_size)).
    _, block_size, _, _ = check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
    raise NotImplementedError(
        "reshape_and_cache: keep only tokens whose slot is >= 0 (slot -1 is padding and writes nothing; "
        "as an index it would hit the cache's last slot), split each slot into "
        "(slot // block_size, slot % block_size) and assign key_cache[block, offset] = key[token] "
        "(same for value). Return nothing."
    )


def gather_kv(key_cache, value_cache, block_table_row, seq_len: int):
    """Contiguous K and V [seq_len, num_kv_heads, head_dim] of one sequence (a helper for the two below)."""
    raise NotImplementedError(
        "gather_kv: take the first ceil(seq_len / block_size) entries of block_table_row (never the -1 "
        "padding), index key_cache with them (.long()), flatten to [n * block_size, kv_heads, d] and keep "
        "exactly seq_len rows (slots past seq_len hold stale data). Same for value_cache."
    )


def paged_attention_varlen(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale):
    """query [num_tokens, num_heads, head_dim]; sequence i owns query rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1], which are its LAST q_len positions.
    Returns [num_tokens, num_heads, head_dim] in query's dtype."""
    # Given: raises ValueError naming query / head_dim / num_heads / key_cache / value_cache /
    # block_tables (int32, one row per sequence, used entries in [0, num_blocks)) / seq_lens
    # (int32, >= 1, covered by the table) / scale (finite > 0) / cu_seqlens_q (int32, starts at 0,
    # rises by >= 1, ends at num_tokens, q_len <= seq_len).
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs)
    check_cu_seqlens_q(cu_seqlens_q, seq_lens, query.shape[0], key_cache.device)
    raise NotImplementedError(
        "paged_attention_varlen: for each sequence gather its K/V (gather_kv). GQA: query head h reads KV head "
        "h // (num_heads // num_kv_heads) (repeat_interleave, not repeat). Scores = q . k * scale in float32. "
        "Causal mask with an offset: query t of a sequence is position seq_len - q_len + t and sees keys "
        "0 .. seq_len - q_len + t (a chunk of a prompt sees the whole cached prefix). "
        "Softmax, @ v, cast to query.dtype."
    )


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """query [num_seqs, num_heads, head_dim]: one new token per sequence, at
    position seq_len - 1, attending to all seq_len cached positions (its own included)."""
    # Given: the same ValueErrors as paged_attention_varlen (without cu_seqlens_q).
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) and query.dim() == 3 else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs)
    raise NotImplementedError(
        "paged_attention_decode: varlen with q_len = 1 per sequence (you may call your paged_attention_varlen "
        "with cu_seqlens_q = arange(num_seqs + 1) as int32). The query sees all seq_len positions."
    )
