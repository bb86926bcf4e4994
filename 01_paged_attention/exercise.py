"""Chapter 1 exercise: write the functions that make a KV cache *paged*.

Run the tests against this file with

    .venv/bin/pytest -q tests/test_ch1_*.py --impl=exercise

Start with `tests/test_ch1_examples.py`: each small case there names the
mistake it catches (off-by-one slot, GQA head mapping, causal offset, reading
past seq_len, -1 padding). Stuck? `01_paged_attention/HINTS.md` has hints in
three levels, from the idea to the last push before the solution; read only
as much as you need. The allocator and the cache allocation are given
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
        "compute_slot_mapping(block_tables [num_reqs, max_blocks] int32, req_indices [T], positions [T], "
        "block_size) -> int64 [T]: the flat cache slot (in [0, num_blocks * block_size)) that holds token "
        "(req_indices[t], positions[t]) under that request's block table; raise ValueError as the docstring "
        "lists (check_tensor from mini_vllm.kernels.validation does the tensor checks)."
    )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the caches
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping, in place."""
    # Given: raises ValueError naming key / value / key_cache / value_cache / slot_mapping
    # (dtype, shape, device, slot outside [-1, num_blocks * block_size)).
    _, block_size, _, _ = check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
    raise NotImplementedError(
        "reshape_and_cache(key, value [T, kv_heads, d], key_cache, value_cache [num_blocks, block_size, "
        "kv_heads, d], slot_mapping [T]) -> None: afterwards the caches, seen as num_blocks * block_size "
        "flat slots, hold key[t] / value[t] at slot slot_mapping[t]; a slot of -1 is padding and writes "
        "nothing; every other slot is left untouched."
    )


def gather_kv(key_cache, value_cache, block_table_row, seq_len: int):
    """Contiguous K and V [seq_len, num_kv_heads, head_dim] of one sequence (a helper for the two below)."""
    raise NotImplementedError(
        "gather_kv(key_cache, value_cache [num_blocks, block_size, kv_heads, d], block_table_row [max_blocks] "
        "int32, seq_len) -> (K, V), each [seq_len, kv_heads, d]: row j is the KV of the sequence's position j. "
        "Only the entries of the row that hold positions < seq_len are read (the rest may be -1 padding or "
        "another sequence's blocks)."
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
        "paged_attention_varlen(query [T, num_heads, d], key_cache / value_cache [num_blocks, block_size, "
        "kv_heads, d], block_tables [num_seqs, max_blocks] int32, cu_seqlens_q [num_seqs + 1] int32, "
        "seq_lens [num_seqs] int32, scale) -> [T, num_heads, d] in query.dtype. Sequence i owns query rows "
        "cu_seqlens_q[i]:cu_seqlens_q[i+1], its last q_len positions. Each row equals dense causal attention "
        "with `scale`, in float32, over the K/V its sequence holds at positions 0 up to the row's own "
        "position, cached prefix included (the tests' oracle, to 1e-5 in fp32). GQA: query heads share KV "
        "heads in contiguous groups as in Llama (num_heads // num_kv_heads query heads per KV head). Only "
        "the table entries holding positions < seq_len are read; no input is modified; argument errors are "
        "raised by the given checks above."
    )


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """query [num_seqs, num_heads, head_dim]: one new token per sequence, at
    position seq_len - 1, attending to all seq_len cached positions (its own included)."""
    # Given: the same ValueErrors as paged_attention_varlen (without cu_seqlens_q).
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) and query.dim() == 3 else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs)
    raise NotImplementedError(
        "paged_attention_decode(query [num_seqs, num_heads, d], key_cache, value_cache, block_tables, "
        "seq_lens, scale) -> [num_seqs, num_heads, d] in query.dtype: row i is the attention of sequence "
        "i's one new token, at position seq_lens[i] - 1, over all its seq_lens[i] cached positions (its own "
        "included); equal to paged_attention_varlen with one query row per sequence. Argument errors are "
        "raised by the given checks above."
    )
