"""Writing new keys/values into the paged cache.

vLLM counterpart: `reshape_and_cache` in `csrc/cache_kernels.cu`, called from
Python as `reshape_and_cache_flash` (`vllm/_custom_ops.py`) by the attention
backend before attention runs.

Invariants: slot -1 marks a padding token and writes nothing; every other slot
is in [0, num_blocks * block_size); two tokens of one call never share a slot
(the scheduler guarantees it; the result would be undefined otherwise).

An fp8 cache (`kv_cache_dtype` "fp8", "fp8_e4m3", "fp8_e5m2": the cache tensor's
dtype is the format) stores fp8(key / k_scale) and fp8(value / v_scale), as
vLLM's `reshape_and_cache_flash(..., kv_cache_dtype, k_scale, v_scale)` does;
any other cache stores the values as they are and takes scale 1.0 only.
"""
from __future__ import annotations

import torch

from mini_vllm.kernels.kv_cache_dtype import quantize

from .checks import check_reshape_and_cache_args


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """key, value [num_tokens, num_kv_heads, head_dim]; writes in place (quantized
    by k_scale / v_scale into an fp8 cache)."""
    _, block_size, _, _ = check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping,
                                                       k_scale, v_scale)
    real = slot_mapping >= 0
    slots = slot_mapping[real].long()
    # (block, offset) indexing works for any cache strides, no view needed.
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = quantize(key[real], float(k_scale), key_cache.dtype)
    value_cache[blocks, offsets] = quantize(value[real], float(v_scale), value_cache.dtype)
