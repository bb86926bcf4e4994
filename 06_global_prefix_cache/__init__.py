"""Chapter 6: a global prefix cache shared across processes and nodes.

A KV connector (vLLM's `KVConnectorBase_V1` interface) lets an engine load
KV blocks that another engine computed, from a store shared by all of them:
an in-process LRU pool, a Valkey/Redis server, or (optionally) Mooncake Store.
`PDConnector` hands whole prompts from a prefill engine to a decode engine
(prefill/decode disaggregation; processes and proxy in `pd.py`).
"""
from mini_vllm.global_cache.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from mini_vllm.global_cache.config import KV_ROLES, KVTransferConfig
from mini_vllm.global_cache.connector import GlobalCacheConnector, GlobalCacheMetadata
from mini_vllm.global_cache.factory import KVConnectorFactory, build_connectors, layout_for, make_store
from mini_vllm.global_cache.keys import block_key, block_keys, layout_fingerprint
from mini_vllm.global_cache.layout import KVLayout, model_content_id
from mini_vllm.global_cache.local_pool import LocalLRUPool, drop_local_pool, get_local_pool
from mini_vllm.global_cache.pd_connector import PDConnector
from mini_vllm.global_cache.serde import pack_block, unpack_block
from mini_vllm.global_cache.stats import ConnectorStats
from mini_vllm.global_cache.store import CorruptBlockError, KVStore, StoreUnavailable

__all__ = [
    "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "KV_ROLES", "KVTransferConfig",
    "GlobalCacheConnector", "GlobalCacheMetadata", "KVConnectorFactory", "build_connectors",
    "layout_for", "make_store", "KVLayout", "block_key", "block_keys", "layout_fingerprint",
    "model_content_id", "LocalLRUPool",
    "drop_local_pool", "get_local_pool", "CorruptBlockError", "pack_block", "unpack_block",
    "ConnectorStats", "KVStore", "StoreUnavailable", "PDConnector",
]
