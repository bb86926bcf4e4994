"""`GlobalCacheConnector`: a prefix cache shared through a KV store.

vLLM counterparts: `vllm/distributed/kv_transfer/kv_connector/v1/
lmcache_connector.py` and `mooncake_connector.py` (a store-backed connector),
with the interface of `base.py` in this chapter.

Scheduler side (role SCHEDULER):
* `get_num_new_matched_tokens` hashes the request's full blocks (Chapter 2's
  chain, cache salt included), builds their keys, and *fetches and verifies*
  the longest run of blocks after the local hit (one `batch_get`, bounded by
  the store's timeout). Fetching at lookup, not only asking `exists`, is the
  design choice that keeps the invariant "no wrong load" simple: the scheduler
  is told about a block only when its verified bytes are in hand, so a store
  that dies, slows down or returns a corrupted value between lookup and load
  cannot leave a request with KV it was promised but never got. The cost: a
  request that fails admission keeps its fetched blocks until it is admitted
  or finished.
The rest (allocation, per-step metadata, the worker side) is given in
`connector_base.py`; keys come from `keys.py`, the block format from `serde.py`.
"""
from __future__ import annotations

import logging

import torch

from .connector_base import GlobalCacheConnectorBase, GlobalCacheMetadata, _Tracked  # noqa: F401
from .keys import block_keys
from .serde import pack_block, unpack_block
from .store import CorruptBlockError, StoreUnavailable

logger = logging.getLogger("mini_vllm.global_cache")


class GlobalCacheConnector(GlobalCacheConnectorBase):
    block_keys = staticmethod(block_keys)
    pack_block = staticmethod(pack_block)
    unpack_block = staticmethod(unpack_block)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        t = self._track(request)
        if not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        bs = self.block_size
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs  # never the last token: it must be computed
        if start * bs >= request.num_tokens - 1:  # nothing left beyond the local hit
            t.fetched, t.fetch_start = [], start
            return 0, False
        have = t.fetched[start - t.fetch_start:] if t.fetch_start <= start else []
        if not have:
            have = self._fetch(t, start, end)
        t.fetched, t.fetch_start = have, start
        # Full blocks only here; a P/D subclass may add a partial last block.
        return min(len(have) * bs, request.num_tokens - 1 - start * bs), False

    def _fetch(self, t: _Tracked, start: int, end: int) -> list[torch.Tensor]:
        keys = self._keys(t, end)[start:end]
        if not keys:
            return []
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(keys)
        try:
            values = self.store.batch_get(keys)
        except StoreUnavailable as e:
            self.stats.store_errors += 1
            logger.warning("KV store unavailable at lookup, recomputing locally: %s", e)
            return []
        out = []
        for k, v in zip(keys, values):
            if v is None:
                break
            try:
                out.append(self.unpack_block(k, v, self.layout))
            except CorruptBlockError as e:
                self.stats.corrupt_blocks += 1
                logger.warning("KV block rejected, treated as a miss: %s", e)
                break  # later blocks chain through this one: they are not a prefix
        self.stats.hit_blocks += len(out)
        return out

