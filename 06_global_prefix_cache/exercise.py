"""Chapter 6 exercise: write the shared pool's core, the keys, the block format and the matching.

Run the chapter's tests against your code with
    .venv/bin/pytest -q tests/test_ch6_*.py --impl=exercise
Each test's message names the mistake it catches. The unit tests come first
(tests/test_ch6_units.py, no model); then engines built with
`kv_transfer_config={..., "kv_connector_module_path": "mini_vllm.global_cache.exercise"}`
share an in-process pool through your connector, and their tokens must equal
an engine's without the pool. Stuck? `06_global_prefix_cache/HINTS.md` has
hints in three levels, from the idea to the last push before the solution.

You write four pieces:
- `block_keys`: the store key of every full block of a request;
- `pack_block` / `unpack_block`: one KV block as bytes and back, refusing
  anything but the exact value written under that key;
- `GlobalCacheConnector.get_num_new_matched_tokens`: how many tokens beyond
  the local prefix hit can be loaded from the store.

Given: the layout (`KVLayout`), Chapter 2's chain hash (`hash_block_tokens`,
`hash_request_tokens`), the stores, and the rest of the connector
(`GlobalCacheConnectorBase`: request tracking, `update_state_after_alloc`,
`build_connector_meta`, the worker side), which call your functions. Nothing
here imports the modules that hold the answers (`keys.py`, `serde.py`,
`connector.py`).
vLLM counterparts: `vllm/distributed/kv_transfer/kv_connector/v1/base.py`,
`lmcache_connector.py`, `mooncake_connector.py`.
"""
from __future__ import annotations

import hashlib  # noqa: F401  (for your keys and checksums)
import struct  # noqa: F401
from typing import Sequence

import torch

from mini_vllm.kvcache import hash_block_tokens, hash_request_tokens  # noqa: F401  (Chapter 2, given)

from .base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole  # noqa: F401
from .config import KVTransferConfig  # noqa: F401
from .connector_base import GlobalCacheConnectorBase, GlobalCacheMetadata, _Tracked  # noqa: F401
from .layout import KVLayout
from .local_pool import LocalLRUPool  # noqa: F401
from .stats import ConnectorStats  # noqa: F401
from .store import CorruptBlockError, StoreUnavailable  # noqa: F401


def block_keys(prefix: str, layout: KVLayout, token_ids: Sequence[int], cache_salt: str | None = None) -> list[str]:
    """TODO: one store key (a str) per full block of `token_ids`."""
    raise NotImplementedError(
        "block_keys(prefix, layout, token_ids, cache_salt=None) -> list of str, one per FULL block of "
        "token_ids (layout.block_size tokens; a trailing partial block has no key). Contract: key i is "
        "equal for two calls iff block i's KV bytes must be equal: it depends on the prefix (a namespace "
        "in a shared server), on every field of `layout` (model, dtype, block size, layers, KV heads, head "
        "dim, tensor-parallel rank: another model or dtype must never load these blocks), on the cache "
        "salt, and on the tokens of block i and of every block before it; it is the same in every process "
        "(no Python hash()). Keys are plain text (a Valkey server stores them).")


def pack_block(key: str, block: torch.Tensor) -> bytes:
    """TODO: `block` ([layers, 2, block_size, kv_heads, head_dim], on CPU) as bytes."""
    raise NotImplementedError(
        "pack_block(key, block [layers, 2, block_size, kv_heads, head_dim] float32/bfloat16/float16 on "
        "CPU) -> bytes that unpack_block(key, data, layout) turns back into a bit-identical tensor. "
        "Raise ValueError naming the dtype for any other dtype.")


def unpack_block(key: str, data: bytes, layout: KVLayout) -> torch.Tensor:
    """TODO: the block stored in `data` under `key`, or raise CorruptBlockError."""
    raise NotImplementedError(
        "unpack_block(key, data, layout) -> the tensor that pack_block(key, x) packed, with "
        "layout.block_shape and layout's dtype, bit-identical; or CorruptBlockError (never another "
        "exception, never a tensor) when data is anything else: any flipped bit, a truncated or extended "
        "value, an empty one, a value packed under another key (its message must say 'another key'), a "
        "value of another dtype or shape.")


class GlobalCacheConnector(GlobalCacheConnectorBase):
    """Your pieces plugged into the given connector."""

    block_keys = staticmethod(block_keys)
    pack_block = staticmethod(pack_block)
    unpack_block = staticmethod(unpack_block)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """TODO: (tokens beyond `num_computed_tokens` fetched and verified from the store, False)."""
        raise NotImplementedError(
            "get_num_new_matched_tokens(request, num_computed_tokens) -> (n, False). request has "
            "request_id, all_token_ids, num_tokens and maybe cache_salt; num_computed_tokens (a multiple "
            "of block_size) are the local prefix hit. Contract: n is the number of tokens after the local "
            "hit whose blocks are in self.store, verified (self.unpack_block) and contiguous: the match "
            "ends at the first block that is missing or rejected (later blocks chain through it); n is a "
            "whole number of blocks and never covers the request's last token (it must be computed). A "
            "kv_producer (not self.kv_transfer_config.is_kv_consumer) never loads: n = 0. A store that "
            "raises StoreUnavailable costs a miss (n = 0), never an exception. Interface with the given "
            "code: call t = self._track(request) first (every role); store the verified tensors in "
            "t.fetched and the first fetched block's index in t.fetch_start (update_state_after_alloc "
            "loads them); self._keys(t, n_blocks) gives the request's first n_blocks keys (your "
            "block_keys). Count self.stats.lookups, lookup_blocks, hit_blocks, corrupt_blocks and "
            "store_errors.")


__all__ = [
    "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "KVTransferConfig", "KVLayout",
    "GlobalCacheConnector", "GlobalCacheMetadata", "LocalLRUPool", "ConnectorStats", "CorruptBlockError",
    "StoreUnavailable", "block_keys", "pack_block", "unpack_block",
]
