"""Chapter 2 exercise: write the hash chain, the LRU policy and the prefix lookup.

Run the chapter's tests against your code with
    .venv/bin/pytest -q tests/test_ch2_*.py --impl=exercise
Start with `tests/test_ch2_examples.py`: each of its small cases names the
mistake it catches. Stuck? `02_kvcache/HINTS.md` has hints in three levels,
from the idea to a near-solution; read only as much as you need.

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
        "hash_block_tokens(parent_hash: 32 bytes or None, token_ids, extra_keys: strings or None) -> 32 bytes. "
        "Contract: equal inputs give equal digests in every process (no Python hash(): PYTHONHASHSEED); "
        "None and NONE_HASH as parent are the same; any other change gives another digest: the parent "
        "(the same tokens after another prefix are other KV), any token, the token count ([1, 2] vs "
        "[1, 2, 0]; [256] vs [1, 0]) and the extra keys (['ab'] vs ['a', 'b'], ['x'] vs none). "
        "A sha256 digest (collisions must be negligible).")


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
            "get_new_blocks(num_blocks) -> that many blocks, each with ref_cnt 1, taken from the free "
            "queue in LRU order (the least recently freed first). A block taken this way no longer answers "
            "a lookup of the hash it held (its old content is about to be overwritten). Raise ValueError "
            "when fewer than num_blocks blocks are free, before changing anything.")

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """TODO: take one reference on each block (a prefix hit, or a fork)."""
        raise NotImplementedError(
            "touch(blocks) -> None: each block gains one reference (a prefix hit or a fork). Invariant: a "
            "block is in the free queue iff its ref_cnt is 0, so a touched block can no longer be evicted; "
            "its hash stays (it is still a cache hit for others).")

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """TODO: drop one reference per listed block; blocks reaching 0 join the queue's tail."""
        raise NotImplementedError(
            "free_blocks(ordered_blocks) -> None: each listed block loses one reference; those reaching 0 "
            "join the free queue's tail in the given order (the first listed is evicted first), keeping "
            "their hash. All or nothing: a block listed more times than it has references is a double "
            "free -> ValueError containing 'double free', raised before any count changes.")


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
            "get_computed_blocks(request) -> (blocks, num_tokens): the longest run of cached full blocks "
            "at the head of the request's tokens, and its length in tokens ([], 0 without caching). The "
            "last prompt token is never covered (its logits are needed). A block counts only if every block "
            "before it did. Reference counts are not changed (allocate_slots touches the hits); "
            "self.prefix_cache_stats counts the request, its tokens (queries) and the hit tokens.")

    def free(self, request: Any) -> None:
        """TODO: release all the request's blocks, TAIL FIRST."""
        raise NotImplementedError(
            "free(request) -> None: every block the request holds loses its reference, and the request's "
            "state is forgotten (self._pop_request_state gives its blocks in logical order). Blocks join "
            "the free queue tail first, so a shared prefix's head stays cached longest. A request that "
            "holds nothing (unknown or already freed) is a no-op.")


__all__ = [
    "KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool", "KVCacheManager",
    "PrefixCacheStats", "hash_block_tokens", "NONE_HASH", "hash_request_tokens",
    "SimpleRequest",
]
