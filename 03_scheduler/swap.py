"""A CPU block pool for swap preemption (cf. vLLM v0 `CpuGpuBlockAllocator`;
vLLM v1 dropped swapping in favour of recompute, seed 004).

A plain free list of CPU block ids: the scheduler only needs to know which
CPU slots are free. The runner executes the (gpu, cpu) / (cpu, gpu) copies.
Invariant: every id is either free or owned by exactly one swapped request.
"""
from __future__ import annotations

import torch

from mini_vllm.kernels.kv_cache_dtype import as_bytes


class CpuBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # Popped from the end; reversed so block 0 goes first (readable tests).
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n distinct free ids, or None (and nothing taken) if there are fewer."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks or b in self._free:
                raise ValueError(f"CPU block {b} is not allocated (double free?)")
            self._free.append(b)


def copy_blocks(src_layers, dst_layers, pairs) -> None:
    """Execute (src_block, dst_block) moves for every layer's (key, value) cache.

    Used for swap-out (device -> host), swap-in (host -> device) and
    copy-on-write (device -> device); by the model-free `MiniRunner` and by the
    engine's cache engine alike. One batched gather + scatter per tensor: all
    sources are read before any destination is written, so a list may read a
    block that it also writes. An fp8 cache moves as bytes (torch has no CPU
    float8 index_copy_): the same bits, so a swapped or copied block reads back
    with the same scale.
    """
    if not pairs:
        return
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long)
    for src, dst in zip(src_layers, dst_layers):
        for s_t, d_t in zip(src, dst):
            s_t, d_t = as_bytes(s_t), as_bytes(d_t)
            moved = s_t.index_select(0, src_ids.to(s_t.device)).to(d_t.device, non_blocking=True)
            d_t.index_copy_(0, dst_ids.to(d_t.device), moved)
