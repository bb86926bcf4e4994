"""Chapter 2 exercise: write the hash chain, the LRU policy and the prefix lookup.

Run the chapter's tests against your code with
    .venv/bin/pytest -q tests/test_ch2_*.py --impl=exercise
Start with `tests/test_ch2_examples.py`: each of its small cases names the
mistake it catches. Stuck? `02_kvcache/HINTS.md` has hints in three levels,
from the idea to the last push before the solution; read only as much as you need.

You write seven pieces:
- `hash_block_tokens`: one link of the sha256 hash chain;
- `BlockPool.get_new_blocks`: blocks for new tokens, taken in LRU order;
- `BlockPool._maybe_evict_cached_block`: a reused block leaves the prefix cache;
- `BlockPool.touch`: a prefix hit (or a fork) takes a reference;
- `BlockPool.free_blocks`: drop references; a block nobody holds becomes evictable;
- `KVCacheManager.free`: release a request's blocks, tail first;
- `KVCacheManager.get_computed_blocks`: the longest cached prefix of a request.

Given, from modules that hold no answer: the doubly linked free queue
(`FreeKVCacheBlockQueue`: `popleft`, `popleft_n`, `remove`, `append`, O(1)
each, `kv_cache_utils.py`), the hash map (`block_hash_map.py`), the chain over
a request's blocks (`block_hash_chain.py`, which calls your
`hash_block_tokens`), and the rest of the pool and manager
(`block_pool_base.py`, `kv_cache_manager_base.py`: `cache_full_blocks`,
`allocate_slots` with copy-on-write, `fork`, ...), which call your methods.
The reference (`block_hash.py`, `block_pool.py`, `kv_cache_manager.py`) is
not imported here: a method you have not written raises, it never runs the
reference's answer.
vLLM counterparts: `vllm/v1/core/kv_cache_utils.py`, `block_pool.py`, `kv_cache_manager.py`.
"""
from __future__ import annotations

import hashlib  # noqa: F401  (for your hash_block_tokens)
import struct  # noqa: F401
from typing import Any, Iterable, Sequence

from .block_hash_chain import NONE_HASH, hash_block_chain
from .block_pool_base import BlockPoolBase
from .kv_cache_manager_base import KVCacheManagerBase
from .kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from .request import SimpleRequest
from .stats import PrefixCacheStats


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
    return hash_block_chain(hash_block_tokens, block_size, token_ids, cache_salt, parent_hash, start_block)


class BlockPool(BlockPoolBase):
    """Given (`BlockPoolBase`): `blocks` (every KVCacheBlock, by id),
    `free_block_queue` (head = least recently freed = evicted first),
    `cached_block_hash_to_block` (hash -> block multimap with `get_one_block`,
    `insert`, `pop(hash, block_id)`), `get_cached_block`, `cache_full_blocks`,
    `reset_prefix_cache`, `get_num_free_blocks`, `get_usage`.
    Invariants your methods keep: a block is in the free queue <=> its ref_cnt
    == 0; `cached_block_hash_to_block` holds block b under hash h <=>
    `b.block_hash == h`.
    """

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """TODO: take `num_blocks` blocks for new tokens, each with ref_cnt 1."""
        raise NotImplementedError(
            "get_new_blocks(num_blocks: int >= 0) -> a list of that many blocks, each taken out of the free "
            "queue with ref_cnt 1, in LRU order (the least recently freed first, the queue's head). A block "
            "taken this way no longer answers a lookup of the hash it held: its old content is about to be "
            "overwritten (your _maybe_evict_cached_block states what that leaves true). Errors: ValueError "
            "whose message contains 'cannot get' when fewer than num_blocks blocks are free, raised before "
            "anything changes.")

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """TODO: `block` is being reused for new tokens; drop it from the prefix cache if it is cached."""
        raise NotImplementedError(
            "_maybe_evict_cached_block(block) -> bool. Receives a block that get_new_blocks is handing out "
            "for new tokens (taken from the free queue, ref_cnt 0). If it carries a hash h: afterwards "
            "cached_block_hash_to_block no longer holds this block under h (other blocks cached under h "
            "stay: the map is a multimap), block.block_hash is None, and it returns True. A block without a "
            "hash (never cached, or already evicted) is a no-op that returns False. It leaves ref_cnt and "
            "the free queue alone.")

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """TODO: take one reference on each block (a prefix hit, or a fork)."""
        raise NotImplementedError(
            "touch(blocks) -> None: each block gains one reference (a prefix hit or a fork), whether it was "
            "free or already in use. Invariant: a block is in the free queue iff its ref_cnt is 0, so a "
            "touched block can no longer be evicted; its hash stays (it is still a cache hit for others).")

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """TODO: drop one reference per listed block; blocks reaching 0 become evictable."""
        raise NotImplementedError(
            "free_blocks(ordered_blocks: any iterable, a block may appear several times) -> None: each "
            "listed block loses one reference; those reaching 0 join the free queue's tail in the given "
            "order (the first listed is evicted first), keeping their hash. All or nothing: a block listed "
            "more times than it has references is a double free -> ValueError containing 'double free', "
            "raised before any count changes.")


class KVCacheManager(KVCacheManagerBase):
    """Given (`KVCacheManagerBase`): `allocate_slots` (takes hits with `touch`,
    new blocks with `get_new_blocks`, copy-on-write), `fork`, `get_block_ids`,
    `get_blocks`, `_block_hashes(request, n)` (the request's first n block
    hashes, through `hash_request_tokens` above), `_pop_request_state`, and
    `prefix_cache_stats`.
    """

    block_pool_cls = BlockPool
    hash_request_tokens = staticmethod(hash_request_tokens)

    def get_computed_blocks(self, request: Any,
                            record_stats: bool = True) -> tuple[list[KVCacheBlock], int]:
        """TODO: (hit blocks, hit tokens): the longest run of cached full blocks at the head."""
        raise NotImplementedError(
            "get_computed_blocks(request, record_stats=True) -> (blocks, num_tokens): the longest run of "
            "cached full blocks at the head of the request's tokens, in logical order, and its length in "
            "tokens ([], 0 when caching is off). The last prompt token is never covered (its logits are "
            "needed). Block i counts only if blocks 0..i-1 did. Reference counts are not changed "
            "(allocate_slots touches the hits). With caching on and record_stats, self.prefix_cache_stats "
            "counts the lookup: one request, its num_tokens as queries, the returned tokens as hits; "
            "record_stats=False is a probe that leaves the stats alone (a scheduler that looks a request up "
            "many times counts it once).")

    def free(self, request: Any) -> None:
        """TODO: release all the request's blocks, tail first."""
        raise NotImplementedError(
            "free(request) -> None: every block the request holds loses one reference, and the request's "
            "state is forgotten (self._pop_request_state gives its blocks in logical order). Its blocks "
            "join the free queue tail first (its last block is evicted first), so a shared prefix's head "
            "stays cached longest. A request that holds nothing (unknown or already freed) is a no-op.")


__all__ = [
    "KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool", "KVCacheManager",
    "PrefixCacheStats", "hash_block_tokens", "NONE_HASH", "hash_request_tokens",
    "SimpleRequest",
]
