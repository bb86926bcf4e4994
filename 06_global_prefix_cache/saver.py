"""Asynchronous saves: a background thread that puts serialized blocks.

vLLM counterpart: the async save paths of the connectors
(`lmcache_connector.py` → LMCache's store thread; `mooncake_connector.py`'s
sender threads), which keep the network off the forward pass.

Invariants:
* `submit` never blocks: when more than `max_pending_bytes` wait already, the
  new batch is dropped and counted (`dropped_blocks`); a save is only an
  optimisation, its loss costs a recompute elsewhere, never a wrong token;
* a failed put (store down) is counted in `failed_blocks` and logged once per
  outage, never raised into the engine;
* `flush(timeout_s)` waits at most `timeout_s` for the queue to drain.
"""
from __future__ import annotations

import logging
import threading
from collections import deque

from .store import StoreUnavailable

logger = logging.getLogger("mini_vllm.global_cache")


class AsyncSaver:
    def __init__(self, store, max_pending_bytes: int, stats) -> None:
        self.store = store
        self.max_pending_bytes = int(max_pending_bytes)
        self.stats = stats
        self._queue: deque[list[tuple[str, bytes]]] = deque()
        self._pending_bytes = 0
        self._in_flight = 0
        self._cv = threading.Condition()
        self._closed = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="kv-saver", daemon=True)
        self._thread.start()

    def submit(self, items: list[tuple[str, bytes]]) -> bool:
        if not items:
            return True
        n = sum(len(v) for _, v in items)
        with self._cv:
            if self._pending_bytes + n > self.max_pending_bytes:
                self.stats.saves_dropped += len(items)
                return False
            self._queue.append(items)
            self._pending_bytes += n
            self._cv.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed and not self._queue:
                    return
                items = self._queue.popleft()
                self._in_flight += 1
            try:
                self.store.batch_put(items)
                self.stats.blocks_saved += len(items)
                self.stats.bytes_saved += sum(len(v) for _, v in items)
                self._warned = False
            except StoreUnavailable as e:
                self.stats.store_errors += 1
                self.stats.saves_failed += len(items)
                if not self._warned:
                    logger.warning("KV store unavailable, %d block save(s) lost: %s", len(items), e)
                    self._warned = True
            except Exception:  # a bug in a backend must not kill the thread silently
                self.stats.saves_failed += len(items)
                logger.exception("KV save failed")
            finally:
                with self._cv:
                    self._in_flight -= 1
                    self._pending_bytes -= sum(len(v) for _, v in items)
                    self._cv.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """True when every submitted save was attempted within `timeout_s`."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._in_flight, timeout_s)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
