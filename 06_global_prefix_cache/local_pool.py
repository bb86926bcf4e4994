"""The in-process KV pool: an LRU of block values under a byte budget.

vLLM counterpart: LMCache's local CPU backend (used through
`lmcache_connector.py`) and vLLM's own CPU offloading (`vllm/v1/kv_offload/`,
with an LRU policy).

Invariants:
* `used_bytes` = sum of the stored values' lengths <= `capacity_bytes`;
* a get or put of a key makes it the most recently used; eviction takes the
  least recently used first;
* a value larger than the whole budget is not stored (counted in `rejected`).
Pools are shared by name inside one process (`get_local_pool`), so two
engines in one process, or an engine's two connector instances, see one pool.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from .store import KVStore


class LocalLRUPool(KVStore):
    name = "local"

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.evictions = 0
        self.rejected = 0
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()  # the saver thread puts while the scheduler gets

    def __len__(self) -> int:
        return len(self._data)

    def batch_put(self, items) -> None:
        with self._lock:
            for key, value in items:
                n = len(value)
                if n > self.capacity_bytes:
                    self.rejected += 1
                    continue
                old = self._data.pop(key, None)
                if old is not None:
                    self.used_bytes -= len(old)
                while self.used_bytes + n > self.capacity_bytes:
                    _, ev = self._data.popitem(last=False)
                    self.used_bytes -= len(ev)
                    self.evictions += 1
                self._data[key] = bytes(value)
                self.used_bytes += n

    def batch_get(self, keys):
        out = []
        with self._lock:
            for key in keys:
                v = self._data.get(key)
                if v is not None:
                    self._data.move_to_end(key)
                out.append(v)
        return out

    def batch_exists(self, keys):
        with self._lock:
            return [k in self._data for k in keys]

    def raw_set(self, key: str, value: bytes) -> None:
        """Overwrite a value in place (tests corrupt values through it)."""
        with self._lock:
            old = self._data.get(key)
            self.used_bytes += len(value) - (len(old) if old is not None else 0)
            self._data[key] = bytes(value)


_POOLS: dict[str, LocalLRUPool] = {}
_POOLS_LOCK = threading.Lock()


def get_local_pool(name: str, capacity_bytes: int) -> LocalLRUPool:
    """The process-wide pool called `name`, created with `capacity_bytes` on first use."""
    with _POOLS_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = LocalLRUPool(int(capacity_bytes))
        return pool


def drop_local_pool(name: str) -> None:
    with _POOLS_LOCK:
        _POOLS.pop(name, None)
