"""The KV cache manager: the prefix lookup and the release of a request.

vLLM counterpart: `vllm/v1/core/kv_cache_manager.py` (`KVCacheManager`), with
`find_longest_cache_hit` and `free` of
`vllm/v1/core/single_type_kv_cache_manager.py` folded in.

The rest of the manager (per-request block lists and hashes,
`allocate_slots` with copy-on-write, `fork`) is the given plumbing of
`kv_cache_manager_base.py`, shared with the exercise; its invariants are
stated there. Requests are duck-typed (see that file).
"""
from __future__ import annotations

from typing import Any

from .block_hash import hash_request_tokens
from .block_pool import BlockPool
from .kv_cache_manager_base import KVCacheManagerBase
from .kv_cache_utils import KVCacheBlock


class KVCacheManager(KVCacheManagerBase):
    """`KVCacheManagerBase` plus the prefix lookup and `free`, on the reference
    pool and hash chain."""

    block_pool_cls = BlockPool
    hash_request_tokens = staticmethod(hash_request_tokens)

    # ---- prefix lookup ----------------------------------------------------------
    def get_computed_blocks(self, request: Any,
                            record_stats: bool = True) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the head of the request's tokens.

        Stops at the first miss: a later block's hash chains through the missing
        one, so nothing after a miss can be a valid prefix. At most
        `num_tokens - 1` tokens are returned, so the last token is recomputed
        and the model still produces logits. Ref counts are not changed here.
        `record_stats=False` is a probe: `prefix_cache_stats` is left alone (a
        scheduler that looks a request up many times counts it once, itself).
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = max(request.num_tokens - 1, 0) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hit: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        num_hit_tokens = len(hit) * self.block_size
        if record_stats:
            st = self.prefix_cache_stats
            st.requests += 1
            st.queries += request.num_tokens
            st.hits += num_hit_tokens
        return hit, num_hit_tokens

    # ---- release / share ------------------------------------------------------------
    def free(self, request: Any) -> None:
        """Release all the request's blocks, tail first.

        The tail block lands in the free queue first and is therefore evicted
        first; the shared head of a prefix stays cached longest.
        """
        blocks = self._pop_request_state(request.request_id)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
