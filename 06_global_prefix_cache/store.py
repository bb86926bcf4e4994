"""The small interface every KV store implements: batch put / get / exists.

vLLM counterpart: the store clients behind the connectors, e.g.
`MooncakeDistributedStore` used by `mooncake_connector.py` (put / get /
is_exist, batched), and LMCache's `StorageBackendInterface`.

Contract:
* `batch_get` returns one entry per key: the bytes, or None for a miss;
* `batch_exists` returns one bool per key;
* `batch_put` may silently drop values (a full or evicting store), never
  store a value under another key;
* a store that cannot answer (down, timed out) raises `StoreUnavailable`
  rather than hanging: every call is bounded by the store's timeout.
"""
from __future__ import annotations

from abc import ABC, abstractmethod


class StoreUnavailable(RuntimeError):
    """The store did not answer within its timeout, or refused the connection."""


class CorruptBlockError(ValueError):
    """A stored value failed a check: corrupted, truncated or foreign (a miss, never a load)."""


class KVStore(ABC):
    name = "store"

    @abstractmethod
    def batch_put(self, items: list[tuple[str, bytes]]) -> None: ...

    @abstractmethod
    def batch_get(self, keys: list[str]) -> list[bytes | None]: ...

    @abstractmethod
    def batch_exists(self, keys: list[str]) -> list[bool]: ...

    def close(self) -> None:
        pass
