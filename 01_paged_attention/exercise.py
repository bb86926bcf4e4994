"""Chapter 1 exercise: write the three functions that make a cache *paged*.

Run the tests against this file with

    pytest --impl=exercise tests/test_ch1_*.py

Everything not stubbed below is re-exported from the reference, so the tests of
the parts you have not touched keep passing. Read `slot_mapping.py`,
`cache_ops.py` and `attention.py` only after you have tried.
"""
from __future__ import annotations

import torch

from .attention import gather_kv, paged_attention_varlen  # noqa: F401  (re-exported)
from .kv_cache import BlockAllocator, NoFreeBlocksError, allocate_kv_cache  # noqa: F401


def compute_slot_mapping(block_tables, req_indices, positions, block_size: int) -> torch.Tensor:
    """int64 [num_tokens]: where token (req_indices[t], positions[t]) lives in
    the cache viewed as a flat array of num_blocks * block_size slots."""
    raise NotImplementedError(
        "compute_slot_mapping: look up the physical block "
        "block_tables[req, pos // block_size] and add the offset pos % block_size: "
        "slot = block * block_size + offset. Return int64, and raise ValueError "
        "(naming the argument) if a token lands on a -1 table entry."
    )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the caches
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping, in place."""
    raise NotImplementedError(
        "reshape_and_cache: keep only tokens whose slot is >= 0 (slot -1 is padding), "
        "split each slot into (slot // block_size, slot % block_size) and assign "
        "key_cache[block, offset] = key[token] (same for value). Validate the arguments "
        "with mini_vllm.paged_attention.checks.check_reshape_and_cache_args."
    )


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """query [num_seqs, num_heads, head_dim]: one new token per sequence, at
    position seq_len - 1, attending to all seq_len cached positions."""
    raise NotImplementedError(
        "paged_attention_decode: for each sequence i take the first "
        "ceil(seq_len / block_size) entries of block_tables[i] (never the -1 padding), "
        "gather key_cache[those blocks], flatten to [n * block_size, kv_heads, d] and keep "
        "exactly seq_len rows. Repeat each KV head num_heads // num_kv_heads times (GQA), "
        "then softmax(q . k * scale) @ v in float32, cast to query.dtype."
    )
