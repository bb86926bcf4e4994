"""The given half of the block pool: the blocks, the free queue, the hash map.

vLLM counterpart: `vllm/v1/core/block_pool.py` (`BlockPool`: its constructor,
`get_cached_block`, `cache_full_blocks`, `reset_prefix_cache`,
`get_num_free_blocks`, `get_usage`).

The lesson of the chapter is not in this file: allocation with lazy eviction
(`get_new_blocks`, `_maybe_evict_cached_block`), `touch` and `free_blocks`
are written by a subclass: `block_pool.BlockPool` (the reference) or the
exercise's class. The invariants they keep are in `block_pool.py`.
"""
from __future__ import annotations

from typing import Sequence

from .block_hash_map import BlockHashToBlockMap
from .kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


class BlockPoolBase:
    #: The free-queue class, swappable by a subclass.
    free_queue_cls = FreeKVCacheBlockQueue

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = self.free_queue_cls(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()

    # ---- lookup -----------------------------------------------------------
    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """Any block whose content has `block_hash`, or None on a miss."""
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Record `blocks[num_cached_blocks:num_full_blocks]` under their hashes.

        `block_hashes[i]` is the hash of logical block i; the caller guarantees
        those blocks are now full. Blocks before `num_cached_blocks` are cached
        already (earlier steps, or prefix hits).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if num_full_blocks > len(blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(
                f"num_full_blocks={num_full_blocks} exceeds blocks ({len(blocks)}) or "
                f"hashes ({len(block_hashes)})")
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            h = block_hashes[i]
            block.block_hash = h  # raises if a stale hash is still attached
            self.cached_block_hash_to_block.insert(h, block)

    # ---- maintenance --------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while a block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks
