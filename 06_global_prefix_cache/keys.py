"""Store keys of KV blocks: Chapter 2's chain hash + a fingerprint of the KV layout.

vLLM counterpart: the cache-key logic of LMCache (`CacheEngineKey`: model
name, world size, worker id, chunk hash) that `lmcache_connector.py` relies
on, and `MooncakeStoreConnector`'s key scheme (`mooncake_connector.py`).

A block's key must change whenever its KV bytes could:
* the tokens and everything before them, plus the cache salt (tenant):
  Chapter 2's chain hash already covers these;
* the model (its content, not its path: two machines mount it at different
  paths), dtype, block size, layer count, KV heads, head dim and the
  tensor-parallel rank (each rank holds other heads): the fingerprint.
Invariant: equal keys imply byte-identical KV for a deterministic model.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict
from typing import Sequence

from mini_vllm.kvcache import hash_request_tokens

from .layout import KVLayout, model_content_id  # noqa: F401  (re-exported)


@functools.lru_cache(maxsize=64)
def layout_fingerprint(layout: KVLayout) -> str:
    """Hex sha256 of every layout field (canonical JSON, sorted keys)."""
    raw = json.dumps(asdict(layout), sort_keys=True).encode()
    return hashlib.sha256(raw).hexdigest()


def block_key(prefix: str, fingerprint: str, block_hash: bytes) -> str:
    return f"{prefix}:{fingerprint[:32]}:{block_hash.hex()}"


def block_keys(prefix: str, layout: KVLayout, token_ids: Sequence[int],
               cache_salt: str | None = None) -> list[str]:
    """One store key per full block of `token_ids` (a trailing partial block has none)."""
    fp = layout_fingerprint(layout)
    return [block_key(prefix, fp, h)
            for h in hash_request_tokens(layout.block_size, token_ids, cache_salt=cache_salt)]
