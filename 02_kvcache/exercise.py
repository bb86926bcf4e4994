"""Chapter 2 exercise: write the hash chain, the LRU policy and the prefix lookup.

Run the chapter's tests against your code with
    .venv/bin/pytest -q tests/test_ch2_*.py --impl=exercise
Start with `tests/test_ch2_examples.py`: each of its small cases names the
mistake it catches.

You write six pieces:
- `hash_block_tokens`: one link of the sha256 hash chain;
- `BlockPool.get_new_blocks`: allocation = eviction from the head of the free queue;
- `BlockPool.touch`: a prefix hit takes a reference (and a free block out of the queue);
- `BlockPool.free_blocks`: drop references, queue blocks that reach 0 at the tail;
- `KVCacheManager.free`: release a request's blocks tail first;
- `KVCacheManager.get_computed_blocks`: the longest cached prefix, stopping at the first miss.

Given: the doubly linked free queue (`FreeKVCacheBlockQueue`: `popleft`,
`popleft_n`, `remove`, `append`, O(1) each), the hash map, and the rest of the
pool and manager (`allocate_slots` with copy-on-write, `fork`, ...), which call
your methods. The given classes are copies of the reference *without* the
methods above (see `_given`), so a method you have not written raises instead
of quietly running the reference's answer.
vLLM counterparts: `vllm/v1/core/kv_cache_utils.py`, `block_pool.py`, `kv_cache_manager.py`.
"""
from __future__ import annotations

from mini_vllm.paged_attention.exercise_support import given_class

from typing import Any, Iterable, Sequence

from . import block_hash as _bh
from . import block_pool as _bp
from . import kv_cache_manager as _km
from .block_hash import NONE_HASH
from .kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from .request import SimpleRequest
from .stats import PrefixCacheStats


_given = given_class  # a copy of the reference class without the lesson's methods


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: Sequence[str] | None = None) -> bytes:
    """TODO: the 32-byte sha256 digest of (parent hash, this block's tokens, extra keys)."""
    raise NotImplementedError(
        "hash_block_tokens: parent_hash None means NONE_HASH (h(None, t) == h(NONE_HASH, t)). Hash ONE "
        "bytes object holding the parent hash, then the tokens, then each extra key, and return "
        "hashlib.sha256(data).digest(). The parent must be in it: the same tokens after another prefix "
        "are other KV. The encoding must be unambiguous: put the token count first and every token as a "
        "fixed-width integer, e.g. struct.pack('<I{n}q', n, *token_ids), so [1, 2] != [1, 2, 0] and "
        "[256] != [1, 0]; length-prefix each extra key (utf-8) so ['ab'] != ['a', 'b'] and ['x'] != no "
        "key. Never Python's hash(): it changes from process to process (PYTHONHASHSEED).")


def hash_request_tokens(block_size: int, token_ids: Sequence[int],
                        cache_salt: str | None = None,
                        parent_hash: bytes | None = None,
                        start_block: int = 0) -> list[bytes]:
    """Given: the chain over the full blocks, built on your `hash_block_tokens`
    (the salt goes into block 0 as its extra key)."""
    return _bh.hash_request_tokens(block_size, token_ids, cache_salt, parent_hash,
                                   start_block, hash_fn=hash_block_tokens)


class BlockPool(_given(_bp.BlockPool, "get_new_blocks", "_maybe_evict_cached_block",
                       "touch", "free_blocks")):
    """Given: `blocks` (every KVCacheBlock, by id), `free_block_queue` (head =
    least recently freed = evicted first), `cached_block_hash_to_block` (hash ->
    block multimap with `get_one_block`, `insert`, `pop(hash, block_id)`),
    `get_cached_block`, `cache_full_blocks`, `reset_prefix_cache`,
    `get_num_free_blocks`, `get_usage`.
    Invariant: a block is in the free queue <=> its ref_cnt == 0.
    """

    free_queue_cls = FreeKVCacheBlockQueue

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """TODO: take `num_blocks` blocks for new tokens, each with ref_cnt 1."""
        raise NotImplementedError(
            "get_new_blocks: if num_blocks > self.free_block_queue.num_free_blocks raise ValueError "
            "('cannot get {n} blocks: only {free} free'). Pop them from the HEAD of the free queue "
            "(self.free_block_queue.popleft_n: the least recently freed go first, that is LRU). A popped "
            "block may still be cached: evict it, i.e. self.cached_block_hash_to_block.pop(block.block_hash, "
            "block.block_id) and block.reset_hash(), or a later lookup of the old hash returns a block "
            "that now holds other tokens. Then ref_cnt += 1 on each.")

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """TODO: take one reference on each block (a prefix hit, or a fork)."""
        raise NotImplementedError(
            "touch: for each block, if its ref_cnt is 0 it sits in the free queue (cached but evictable): "
            "unlink it with self.free_block_queue.remove(block), so it cannot be evicted while in use; "
            "keep its hash. Then ref_cnt += 1 for EVERY block, also one already in use (a block shared "
            "by two requests has ref_cnt 2).")

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """TODO: drop one reference per listed block; blocks reaching 0 join the queue's tail."""
        raise NotImplementedError(
            "free_blocks: all or nothing. First check the whole list: a block listed more times than its "
            "ref_cnt is a double free -> ValueError whose message contains 'double free', raised before "
            "any count changes. Then ref_cnt -= 1 per entry, and append (free_block_queue.append) each "
            "block whose ref_cnt reaches 0, in the given order: the first one appended is evicted first. "
            "A block that still has holders must stay out of the queue.")


class KVCacheManager(_given(_km.KVCacheManager, "get_computed_blocks", "free")):
    """Given: `allocate_slots` (takes hits with `touch`, new blocks with
    `get_new_blocks`, copy-on-write), `fork`, `get_block_ids`, `get_blocks`,
    `_block_hashes(request, n)` (the request's first n block hashes), and
    `_pop_request_state` below.
    """

    block_pool_cls = BlockPool
    hash_request_tokens = staticmethod(hash_request_tokens)

    def _pop_request_state(self, request_id: str) -> list[KVCacheBlock] | None:
        """Given: forget everything kept for `request_id` (its hash list too);
        return its blocks in logical order, or None if it holds none."""
        self._req_block_hashes.pop(request_id, None)
        self._hash_owner.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        return self._req_blocks.pop(request_id, None)

    def get_computed_blocks(self, request: Any) -> tuple[list[KVCacheBlock], int]:
        """TODO: (hit blocks, hit tokens): the longest run of cached full blocks at the head."""
        raise NotImplementedError(
            "get_computed_blocks: return ([], 0) when not self.enable_caching. At most "
            "max(request.num_tokens - 1, 0) // self.block_size blocks may hit: the last prompt token is "
            "always recomputed (the model needs its logits). Take those blocks' hashes with "
            "self._block_hashes(request, n) and look each up with self.block_pool.get_cached_block(h), in "
            "order; STOP at the first miss (break, not continue): a later block's KV is only valid after "
            "all the blocks before it. Do not touch ref counts. Update self.prefix_cache_stats: "
            "requests += 1, queries += request.num_tokens, hits += hit tokens (= len(hits) * block_size).")

    def free(self, request: Any) -> None:
        """TODO: release all the request's blocks, TAIL FIRST."""
        raise NotImplementedError(
            "free: blocks = self._pop_request_state(request.request_id); a request that holds nothing "
            "(unknown, or already freed) is a no-op. Pass the blocks to self.block_pool.free_blocks in "
            "reverse logical order (reversed(blocks)): the tail then enters the free queue first and is "
            "evicted first, and the head of a shared prefix stays cached longest. Head first would evict a "
            "chain's head and orphan the rest of it.")


__all__ = [
    "KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool", "KVCacheManager",
    "PrefixCacheStats", "hash_block_tokens", "NONE_HASH", "hash_request_tokens",
    "SimpleRequest",
]
