"""The block pool: every physical block, the LRU free queue and the hash map.

vLLM counterpart: `vllm/v1/core/block_pool.py` (`BlockPool`).

Invariants (checked by `tests/test_ch2_stateful.py` after every step)
--------------------------------------------------------------------
* Every block is either in the free queue with `ref_cnt == 0`, or out of it
  with `ref_cnt > 0`; never both, never neither.
* `num_free_blocks + num_used_blocks == num_blocks`.
* `cached_block_hash_to_block[h][block_id] is block`  <=>  `block.block_hash == h`.
  A hash may map to several blocks (a multimap): two requests that miss on the
  same prefix at the same time each compute their own copy.
* A free block may still carry a hash: it is "cached but evictable". A hit on
  it takes it out of the queue (lazy removal, `touch`); reusing it for new
  tokens evicts the hash (`get_new_blocks`).
"""
from __future__ import annotations

from typing import Iterable

from .block_pool_base import BlockPoolBase
from .kv_cache_utils import KVCacheBlock


class BlockPool(BlockPoolBase):
    """The block pool: `BlockPoolBase` (the blocks, the free queue, the hash
    map, caching full blocks) plus allocation, `touch` and `free_blocks`."""

    # ---- allocation -------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, ref_cnt = 1 each.

        A popped block that still carries a hash is evicted from the cache here.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: only "
                f"{self.free_block_queue.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop `block` from the hash map and clear its hash; False if it held none."""
        h = block.block_hash
        if h is None:
            return False
        self.cached_block_hash_to_block.pop(h, block.block_id)
        block.reset_hash()
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (a prefix hit or a fork).

        A free block (ref_cnt 0) is unlinked from the queue so it can no longer
        be evicted; it keeps its hash.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the tail, in order.

        Pass blocks in eviction order (first = evicted first): the manager
        passes a request's blocks tail first. All or nothing: a double free
        anywhere in the list (a block listed more times than its ref_cnt)
        raises before any count changes.
        """
        blocks = list(ordered_blocks)
        drops: dict[int, int] = {}
        for block in blocks:
            drops[id(block)] = drops.get(id(block), 0) + 1
            if drops[id(block)] > block.ref_cnt:
                raise ValueError(f"double free of block {block.block_id} (ref_cnt={block.ref_cnt}, "
                                 f"freed {drops[id(block)]} times in this call)")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
