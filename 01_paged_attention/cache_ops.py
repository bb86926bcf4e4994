"""Writing new keys/values into the paged cache.

vLLM counterpart: `reshape_and_cache` in `csrc/cache_kernels.cu`, called from
Python as `reshape_and_cache_flash` (`vllm/_custom_ops.py`) by the attention
backend before attention runs.

Invariants: slot -1 marks a padding token and writes nothing; every other slot
is in [0, num_blocks * block_size); two tokens of one call never share a slot
(the scheduler guarantees it; the result would be undefined otherwise).
"""
from __future__ import annotations

import torch

from .checks import check_reshape_and_cache_args


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """key, value [num_tokens, num_kv_heads, head_dim]; writes in place."""
    _, block_size, _, _ = check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
    real = slot_mapping >= 0
    slots = slot_mapping[real].long()
    # (block, offset) indexing works for any cache strides, no view needed.
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[real]
    value_cache[blocks, offsets] = value[real]
