"""A CPU block pool for swap preemption (cf. vLLM v0 `CpuGpuBlockAllocator`;
vLLM v1 dropped swapping in favour of recompute, seed 004).

A plain free list of CPU block ids: the scheduler only needs to know which
CPU slots are free. The runner executes the (gpu, cpu) / (cpu, gpu) copies.
Invariant: every id is either free or owned by exactly one swapped request.
"""
from __future__ import annotations


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
