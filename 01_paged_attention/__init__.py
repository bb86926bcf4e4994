"""Chapter 1: PagedAttention (`mini_vllm.paged_attention`).

The KV cache is cut into fixed-size blocks; a per-sequence block table maps
logical blocks to physical ones, so memory is taken one block at a time
instead of reserved up front (seed 001 §3.4). This package holds the plain
PyTorch reference of every piece; `mini_vllm.kernels` has Triton versions with
the same signatures.

vLLM sources to read next: `vllm/v1/worker/block_table.py`,
`csrc/cache_kernels.cu`, `csrc/attention/paged_attention_v1.cu`,
`vllm/attention/ops/triton_unified_attention.py`, `vllm/v1/core/block_pool.py`.
"""
# Absolute imports on purpose: pytest (collecting this folder's notebook with
# --nbmake) imports this file as a top-level module, since "01_paged_attention"
# is not a valid package name, and relative imports would fail there.
from mini_vllm.paged_attention.attention import gather_kv, paged_attention_decode, paged_attention_varlen
from mini_vllm.paged_attention.cache_ops import reshape_and_cache
from mini_vllm.paged_attention.kv_cache import BlockAllocator, NoFreeBlocksError, allocate_kv_cache
from mini_vllm.paged_attention.slot_mapping import compute_slot_mapping

__all__ = [
    "BlockAllocator",
    "NoFreeBlocksError",
    "allocate_kv_cache",
    "compute_slot_mapping",
    "gather_kv",
    "paged_attention_decode",
    "paged_attention_varlen",
    "reshape_and_cache",
]
