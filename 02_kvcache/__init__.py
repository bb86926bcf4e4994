"""Chapter 2: the KV cache manager (LRU block pool with hash-chain prefix caching).

Modules mirror vLLM v1: `kv_cache_utils.py` (block, free queue),
`block_hash.py` (hash chain), `block_pool.py`, `kv_cache_manager.py`. Their
given halves, which the exercise shares, hold no answer:
`block_hash_chain.py`, `block_pool_base.py`, `kv_cache_manager_base.py`.
"""
# Absolute imports on purpose: pytest --nbmake imports this file as a top-level
# module ("02_kvcache" is not a valid package name), where relative imports fail.
from mini_vllm.kvcache.block_hash import NONE_HASH, hash_block_tokens, hash_request_tokens
from mini_vllm.kvcache.block_pool import BlockPool
from mini_vllm.kvcache.kv_cache_manager import KVCacheManager
from mini_vllm.kvcache.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from mini_vllm.kvcache.request import SimpleRequest
from mini_vllm.kvcache.stats import PrefixCacheStats

__all__ = [
    "KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool", "KVCacheManager",
    "PrefixCacheStats", "hash_block_tokens", "NONE_HASH", "hash_request_tokens",
    "SimpleRequest",
]
