"""Chapter 2 exercise: write the LRU free queue, the hash chain and the prefix lookup.

Run the chapter's tests against your code with
    .venv/bin/python -m pytest -q tests/test_ch2_*.py --impl=exercise

Everything else (block pool, allocation, copy-on-write) is the reference,
wired to your three pieces, so the same tests exercise them end to end.
vLLM counterparts: `vllm/v1/core/kv_cache_utils.py` (queue, hashing) and
`vllm/v1/core/kv_cache_manager.py` (`get_computed_blocks`).
"""
from __future__ import annotations

from typing import Any, Sequence

from . import block_hash as _bh
from . import block_pool as _bp
from . import kv_cache_manager as _km
from . import kv_cache_utils as _ku
from .block_hash import NONE_HASH
from .kv_cache_utils import KVCacheBlock
from .request import SimpleRequest
from .stats import PrefixCacheStats


class FreeKVCacheBlockQueue(_ku.FreeKVCacheBlockQueue):
    """TODO: the doubly linked free list. `__init__` (two sentinels, then
    `append_n`), `popleft_n`, `append_n` and `num_free_blocks` are given; write
    the three O(1) primitives. The links are `block.prev_free_block` /
    `block.next_free_block`; the sentinels are `self._head` / `self._tail`; a
    block outside the queue has both links None. Keep `self.num_free_blocks`
    in step.
    """

    def popleft(self) -> KVCacheBlock:
        # Hint: the LRU block is self._head.next_free_block; if that is the tail
        # sentinel the queue is empty -> raise ValueError with a clear message.
        raise NotImplementedError("exercise: FreeKVCacheBlockQueue.popleft")

    def remove(self, block: KVCacheBlock) -> None:
        # Hint: splice block out by linking its neighbours to each other, then
        # clear its links. Raise ValueError if the block is not in the queue.
        raise NotImplementedError("exercise: FreeKVCacheBlockQueue.remove")

    def append(self, block: KVCacheBlock) -> None:
        # Hint: insert between self._tail.prev_free_block and self._tail.
        raise NotImplementedError("exercise: FreeKVCacheBlockQueue.append")


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: Sequence[str] | None = None) -> bytes:
    """TODO: sha256 digest of (parent hash, this block's tokens, extra keys).

    Hint: parent None means NONE_HASH. Build one bytes object with a stable
    encoding (e.g. struct.pack("<I{n}q", n, *token_ids)), append each extra
    key as length-prefixed utf-8, and return hashlib.sha256(data).digest().
    Never use Python's hash(): it differs between processes.
    """
    raise NotImplementedError("exercise: hash_block_tokens")


def hash_request_tokens(block_size: int, token_ids: Sequence[int],
                        cache_salt: str | None = None,
                        parent_hash: bytes | None = None,
                        start_block: int = 0) -> list[bytes]:
    """Given: the chain over full blocks, built on your `hash_block_tokens`."""
    return _bh.hash_request_tokens(block_size, token_ids, cache_salt, parent_hash,
                                   start_block, hash_fn=hash_block_tokens)


class BlockPool(_bp.BlockPool):
    free_queue_cls = FreeKVCacheBlockQueue


class KVCacheManager(_km.KVCacheManager):
    block_pool_cls = BlockPool
    hash_request_tokens = staticmethod(hash_request_tokens)

    def get_computed_blocks(self, request: Any) -> tuple[list[KVCacheBlock], int]:
        """TODO: the longest cached prefix of full blocks.

        Hints: return ([], 0) when `self.enable_caching` is False. At most
        (request.num_tokens - 1) // self.block_size blocks may hit (the last
        token is always recomputed). `self._block_hashes(request, n)` gives the
        first n block hashes; look each up with
        `self.block_pool.get_cached_block(h)` and stop at the first miss. Do not
        touch ref counts. Update `self.prefix_cache_stats` (requests += 1,
        queries += request.num_tokens, hits += hit tokens).
        """
        raise NotImplementedError("exercise: KVCacheManager.get_computed_blocks")


__all__ = [
    "KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool", "KVCacheManager",
    "PrefixCacheStats", "hash_block_tokens", "NONE_HASH", "hash_request_tokens",
    "SimpleRequest",
]
