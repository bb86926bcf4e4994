"""The paged KV cache tensors of every layer, their size, and block moves.

vLLM counterparts: `GPUModelRunner.initialize_kv_cache` and
`determine_available_memory` (`vllm/v1/worker/gpu_model_runner.py`,
`gpu_worker.py`), and vLLM v0's `CacheEngine` (`vllm/worker/cache_engine.py`),
which owned the CPU swap space and executed swap and copy lists.

Layout: per layer a (key_cache, value_cache) pair, each
[num_blocks, block_size, num_kv_heads, head_dim] (Chapter 1); on the CPU in
memory backed by 2 MiB pages (`host_memory.py`: fewer TLB misses when
attention reads blocks scattered over the cache). Block ids are
shared by all layers: block b of request r is block b in every layer.

An EAGLE head adds `num_draft_layers` layers laid out the same way and
addressed by the same block ids. Their tensors (`draft_cache`) have
`num_scratch_blocks` more blocks past the pool's, which only the proposer
uses; `gpu_cache` lists the pool's part of them, so swaps, copies and KV
connectors move the head's KV with the target's.

Invariant: the moves of one step run in the order swap-out, swap-in, copy
(Chapter 3's protocol), through the same `copy_blocks` that Chapter 3's
model-free `MiniRunner` uses: one batched index copy per tensor.
"""
from __future__ import annotations

import torch

from mini_vllm.paged_attention import allocate_kv_cache
from mini_vllm.paged_attention.kv_cache import kv_cache_shape
from mini_vllm.scheduler.swap import copy_blocks

from .host_memory import hugepage_zeros

CPU_DEFAULT_KV_BYTES = 512 * 1024 * 1024


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int, what: str) -> int:
    n = int(budget_bytes // bytes_per_block)
    if n < 1:
        raise ValueError(f"{what} = {budget_bytes} bytes holds no KV block "
                         f"({bytes_per_block} bytes each); raise it")
    return n


def _layer_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (key_cache, value_cache): Chapter 1's `allocate_kv_cache`, and on the
    CPU the same zero-filled tensors on 2 MiB pages."""
    if device.type != "cpu":
        return allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return hugepage_zeros(shape, dtype), hugepage_zeros(shape, dtype)


class CacheEngine:
    def __init__(self, num_layers: int, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, num_draft_layers: int = 0,
                 num_scratch_blocks: int = 0) -> None:
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.device = torch.device(device)
        self.gpu_cache = [_layer_cache(num_gpu_blocks, block_size, num_kv_heads, head_dim, dtype, self.device)
                          for _ in range(num_layers)]
        self.draft_cache = [_layer_cache(num_gpu_blocks + num_scratch_blocks, block_size, num_kv_heads, head_dim,
                                         dtype, self.device) for _ in range(num_draft_layers)]
        self.gpu_cache += [(k[:num_gpu_blocks], v[:num_gpu_blocks]) for k, v in self.draft_cache]
        num_layers += num_draft_layers
        # Swap space lives in host memory (pinned on CUDA for async copies).
        self.cpu_cache = []
        if num_cpu_blocks:
            for _ in range(num_layers):
                k, v = allocate_kv_cache(num_cpu_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu")
                if self.device.type == "cuda":
                    k, v = k.pin_memory(), v.pin_memory()
                self.cpu_cache.append((k, v))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu_block, cpu_block) pairs: device -> host."""
        if pairs and not self.cpu_cache:
            raise RuntimeError("swap-out requested but the engine has no CPU swap space")
        copy_blocks(self.gpu_cache, self.cpu_cache, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu_block, gpu_block) pairs: host -> device."""
        copy_blocks(self.cpu_cache, self.gpu_cache, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) pairs on the device: copy-on-write of shared blocks."""
        copy_blocks(self.gpu_cache, self.gpu_cache, pairs)
