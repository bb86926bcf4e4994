"""KV cache blocks and the O(1) LRU free queue.

vLLM counterpart: `vllm/v1/core/kv_cache_utils.py` (`KVCacheBlock`,
`FreeKVCacheBlockQueue`). Block hashing, which lives in the same vLLM file,
is in `block_hash.py` here (one concept per file).

Invariants
----------
* A block is in the free queue  <=>  its `ref_cnt` is 0 (the block pool keeps
  this true; the queue itself only maintains the links).
* The queue is ordered by eviction priority: the head is evicted first. Blocks
  freed later go to the tail, so the queue is an LRU list.
* Every operation is O(1) per block: the links live *inside* the blocks, so
  removing a block from the middle (a prefix-cache hit on a free block) needs no
  search.
"""
from __future__ import annotations

from typing import Iterable, Iterator


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints >= 0: the blocks that `a` tokens need (vLLM: `vllm.utils.cdiv`)."""
    return -(-a // b)


class KVCacheBlock:
    """One physical KV block: its id, how many requests hold it, its content hash.

    `block_hash` is None until the block is full and cached; once set it may
    only be cleared by `reset_hash` (on eviction), never overwritten, because a
    stale hash would let a later request read the wrong KV.
    """

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: bytes | None = None
        # Links of the doubly linked free list; None when not in the queue.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    @property
    def block_hash(self) -> bytes | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, value: bytes) -> None:
        if self._block_hash is not None:
            raise ValueError(
                f"block {self.block_id} already has a hash; reset_hash() it first "
                "(overwriting would leave a stale entry in the hash map)")
        self._block_hash = value

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        h = None if self._block_hash is None else self._block_hash.hex()[:8]
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with two sentinel nodes.

    The sentinels mean no operation has to special-case an empty list or the
    ends. `num_free_blocks` is a counter, kept in step with the links.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)  # sentinel: head._next is the LRU block
        self._tail = KVCacheBlock(-2)  # sentinel: tail._prev is the MRU block
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (least recently freed) block."""
        first = self._head.next_free_block
        if first is self._tail:
            raise ValueError("popleft from an empty free block queue: no free KV blocks left")
        self._unlink(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks, in queue order."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.num_free_blocks:
            raise ValueError(
                f"cannot pop {n} blocks: only {self.num_free_blocks} free KV blocks")
        out = []
        for _ in range(n):
            out.append(self.popleft())
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it sits in the queue (O(1))."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail: it will be evicted last."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Append `blocks` at the tail in the given order."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (evicted first) to tail. O(n): for tests/debugging."""
        return list(iter(self))

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free_block
        while node is not self._tail:
            yield node
            node = node.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
