"""Chapter 2: the KV cache manager (LRU block pool with hash-chain prefix caching).

Modules mirror vLLM v1: `kv_cache_utils.py` (block, free queue),
`block_hash.py` (hash chain), `block_pool.py`, `kv_cache_manager.py`.
"""
from .block_hash import NONE_HASH, hash_block_tokens, hash_request_tokens
from .block_pool import BlockPool
from .kv_cache_manager import KVCacheManager
from .kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from .request import SimpleRequest
from .stats import PrefixCacheStats

__all__ = [
    "KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool", "KVCacheManager",
    "PrefixCacheStats", "hash_block_tokens", "NONE_HASH", "hash_request_tokens",
    "SimpleRequest",
]
