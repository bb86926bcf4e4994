"""The paged KV cache itself and a minimal block allocator.

vLLM counterparts: the cache tensors are allocated by the GPU model runner
(`vllm/v1/worker/gpu_model_runner.py`, `initialize_kv_cache`), with the layout
`[num_blocks, block_size, num_kv_heads, head_dim]` used by the flash-attention
backend (`vllm/v1/attention/backends/flash_attn.py`, `get_kv_cache_shape`).
The allocator is a stripped-down `BlockPool` (`vllm/v1/core/block_pool.py`):
a free list plus reference counts, without the LRU order and prefix hashes
that Chapter 2 adds.

Invariants: a block id is either on the free list with ref_cnt 0, or off it
with ref_cnt >= 1; never both.
"""
from __future__ import annotations

from collections import deque

import torch

from mini_vllm.kernels.validation import KV_CACHE_DTYPES


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32) -> tuple:
    """The shape of one layer's key (and value) cache, [num_blocks, block_size, num_kv_heads,
    head_dim], after checking the arguments (vLLM: `AttentionBackend.get_kv_cache_shape`)."""
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        _positive_int(name, v)
    if dtype not in KV_CACHE_DTYPES:  # fp8 formats too: a quantized cache (kv_cache_dtype)
        raise ValueError(f"dtype must be one of {KV_CACHE_DTYPES}, got {dtype}")
    return (num_blocks, block_size, num_kv_heads, head_dim)


def allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
    """One layer's (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim].

    Zero-filled; which slots hold real tokens is known only through block
    tables and sequence lengths, never through the cache contents.
    """
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


class NoFreeBlocksError(RuntimeError):
    """Raised when the pool cannot satisfy an allocation (the scheduler must
    then wait or preempt; it is not a bad-argument error)."""


class BlockAllocator:
    """Hands out physical block ids 0..num_blocks-1 with reference counts.

    `allocate` takes the oldest free block (FIFO free list), `incref` lets a
    second sequence share a block, `free` drops one reference and returns the
    block to the free list when the count reaches 0.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self._free = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def _check_id(self, block_id) -> int:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be an int in [0, {self.num_blocks}), got {block_id!r}")
        return block_id

    def ref_cnt(self, block_id: int) -> int:
        return self._ref[self._check_id(block_id)]

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError(f"out of KV blocks: all {self.num_blocks} are in use")
        block_id = self._free.popleft()
        self._ref[block_id] = 1
        return block_id

    def allocate_n(self, n: int) -> list[int]:
        """All n blocks or none (a half-served request would be useless)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks but only {len(self._free)} are free")
        return [self.allocate() for _ in range(n)]

    def incref(self, block_id: int) -> None:
        if self._ref[self._check_id(block_id)] == 0:
            raise ValueError(f"block {block_id} is free; incref needs an allocated block")
        self._ref[block_id] += 1

    def free(self, block_id: int) -> None:
        if self._ref[self._check_id(block_id)] == 0:
            raise ValueError(f"double free: block {block_id} is already free")
        self._ref[block_id] -= 1
        if self._ref[block_id] == 0:
            self._free.append(block_id)
