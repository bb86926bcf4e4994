"""Hash -> cached block(s): the prefix cache's index.

vLLM counterpart: `BlockHashToBlockMap` in `vllm/v1/core/block_pool.py`.

It is a multimap: two requests that miss on the same prefix at the same
time each compute (and cache) their own copy, so one hash can name several
blocks. Almost always there is one, so a single block is stored directly and
an inner {block_id: block} dict is made only for duplicates: one less object
to touch on every eviction, which matters when the pool is large and memory
access is cold.

Invariant: for every stored (hash, block), `block.block_hash == hash`; no entry
is ever empty.
"""
from __future__ import annotations

from typing import Iterator

from .kv_cache_utils import KVCacheBlock


class BlockHashToBlockMap:
    __slots__ = ("_cache",)

    def __init__(self):
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, block_hash: bytes) -> KVCacheBlock | None:
        v = self._cache.get(block_hash)
        if v is None or type(v) is KVCacheBlock:
            return v
        return next(iter(v.values()))

    def insert(self, block_hash: bytes, block: KVCacheBlock) -> None:
        v = self._cache.get(block_hash)
        if v is None:
            self._cache[block_hash] = block
        elif type(v) is KVCacheBlock:
            self._cache[block_hash] = {v.block_id: v, block.block_id: block}
        else:
            v[block.block_id] = block

    def pop(self, block_hash: bytes, block_id: int) -> KVCacheBlock | None:
        """Remove and return the block `block_id` stored under `block_hash`, if any."""
        v = self._cache.get(block_hash)
        if v is None:
            return None
        if type(v) is KVCacheBlock:
            if v.block_id != block_id:
                return None
            del self._cache[block_hash]
            return v
        block = v.pop(block_id, None)
        if len(v) == 1:
            self._cache[block_hash] = next(iter(v.values()))
        return block

    # ---- read-only views (tests, notebook) -------------------------------------
    def __getitem__(self, block_hash: bytes) -> dict[int, KVCacheBlock]:
        v = self._cache[block_hash]
        return {v.block_id: v} if type(v) is KVCacheBlock else dict(v)

    def items(self) -> Iterator[tuple[bytes, dict[int, KVCacheBlock]]]:
        for h in self._cache:
            yield h, self[h]

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._cache

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()
