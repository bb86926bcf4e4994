"""A Valkey/Redis server as the KV pool shared by engine processes and machines.

vLLM counterpart: LMCache's Redis remote backend (`lmcache/v1/storage_backend/
connector/redis_connector.py`, reached through `lmcache_connector.py`); the
server plays the part of Mooncake Store's master + memory pool. Redis Cluster
(or Valkey cluster) is the path past one machine: keys spread over shards by
hash slot, and the client code stays the same.

Invariants:
* every call is bounded by `timeout_s` (socket connect and read timeouts, no
  client retries), and a failure raises `StoreUnavailable`;
* after a failure the store is considered down for `retry_interval_s`: calls
  fail at once instead of paying the timeout again on every lookup; the
  first call after the interval tries the server again (hits resume when it
  is back).
"""
from __future__ import annotations

import time

from .store import KVStore, StoreUnavailable


class ValkeyStore(KVStore):
    name = "valkey"

    def __init__(self, url: str, timeout_s: float = 0.5, retry_interval_s: float = 2.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.timeout_s = float(timeout_s)
        self.retry_interval_s = float(retry_interval_s)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=self.timeout_s,
                                           socket_connect_timeout=self.timeout_s,
                                           retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        self._down_until = 0.0
        self.num_failures = 0

    def _call(self, fn):
        if time.monotonic() < self._down_until:
            raise StoreUnavailable(f"{self.url} marked down after a failure; retrying later")
        try:
            return fn()
        except self._errors as e:
            self.num_failures += 1
            self._down_until = time.monotonic() + self.retry_interval_s
            self.client.connection_pool.disconnect()  # a half-read socket must not be reused
            raise StoreUnavailable(f"{self.url}: {type(e).__name__}: {e}") from e

    def batch_put(self, items) -> None:
        if not items:
            return

        def put():
            pipe = self.client.pipeline(transaction=False)
            for k, v in items:
                pipe.set(k, v)
            pipe.execute()
        self._call(put)

    def batch_get(self, keys):
        if not keys:
            return []
        return list(self._call(lambda: self.client.mget(keys)))

    def batch_exists(self, keys):
        if not keys:
            return []

        def exists():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(x) for x in pipe.execute()]
        return self._call(exists)

    def close(self) -> None:
        self.client.close()
