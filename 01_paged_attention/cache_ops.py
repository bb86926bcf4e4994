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

from mini_vllm.kernels.validation import check_kv_cache, check_tensor

from .checks import INDEX_DTYPES


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """key, value [num_tokens, num_kv_heads, head_dim]; writes in place."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(key_cache, value_cache)
    dev = key_cache.device
    check_tensor("key", key, ndim=3, dtypes=(key_cache.dtype,), device=dev)
    check_tensor("value", value, ndim=3, dtypes=(key_cache.dtype,), device=dev)
    if key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key shape {tuple(key.shape)} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")
    num_slots = num_blocks * block_size
    if slot_mapping.numel() and (int(slot_mapping.min()) < -1 or int(slot_mapping.max()) >= num_slots):
        raise ValueError(f"slot_mapping entries must be -1 (padding) or in [0, {num_slots}), got range "
                         f"[{int(slot_mapping.min())}, {int(slot_mapping.max())}]")
    real = slot_mapping >= 0
    slots = slot_mapping[real].long()
    # (block, offset) indexing works for any cache strides, no view needed.
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[real]
    value_cache[blocks, offsets] = value[real]
