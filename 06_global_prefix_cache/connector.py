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
* `update_state_after_alloc` pairs the fetched blocks with the block ids the
  scheduler allocated; `build_connector_meta` hands those loads, plus the
  blocks that became full this step (saves), to the worker side.
Worker side (role WORKER): `start_load_kv` writes all loads into every
layer before the forward pass (so `wait_for_layer_load` has nothing to wait
for); `wait_for_save` gathers the blocks to save from all layers after the
forward and queues them for the background saver (one value holds all layers
of a block, so per-layer `save_kv_layer` calls are not needed).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from mini_vllm.kvcache import hash_request_tokens

from .base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from .keys import KVLayout, block_key
from .serde import CorruptBlockError, pack_block, unpack_block
from .stats import ConnectorStats
from .store import StoreUnavailable

logger = logging.getLogger("mini_vllm.global_cache")


@dataclass
class GlobalCacheMetadata(KVConnectorMetadata):
    # (block id, verified block tensor [layers, 2, block_size, kv_heads, head_dim])
    loads: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    saves: list[tuple[str, int]] = field(default_factory=list)  # (store key, block id)


@dataclass
class _Tracked:
    request: object
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_saved_blocks: int = 0
    # Blocks fetched by the last lookup: they start at block `fetch_start`.
    fetch_start: int = 0
    fetched: list[torch.Tensor] = field(default_factory=list)


class GlobalCacheConnector(KVConnectorBase_V1):
    #: Pluggable pieces; the exercise swaps in the learner's versions.
    pack_block = staticmethod(pack_block)
    unpack_block = staticmethod(unpack_block)

    def __init__(self, kv_transfer_config, role: KVConnectorRole, layout: KVLayout, store,
                 stats: ConnectorStats | None = None) -> None:
        KVConnectorBase_V1.__init__(self, kv_transfer_config, role)  # no super(): exercise.py copies this class
        self.layout, self.store = layout, store
        self.block_size = layout.block_size
        self.fingerprint = layout.fingerprint()
        self.key_prefix = kv_transfer_config.extra["key_prefix"]
        self.stats = stats if stats is not None else ConnectorStats()
        self._reqs: dict[str, _Tracked] = {}
        self._pending_loads: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._kv_caches = None
        self.saver = None
        if role == KVConnectorRole.WORKER and kv_transfer_config.is_kv_producer:
            from .saver import AsyncSaver
            self.saver = AsyncSaver(store, kv_transfer_config.extra["max_pending_save_bytes"],
                                    self.stats)

    def key(self, block_hash: bytes) -> str:
        return block_key(self.key_prefix, self.fingerprint, block_hash)

    # ============================================================ scheduler
    def _track(self, request) -> _Tracked:
        t = self._reqs.get(request.request_id)
        if t is None or t.request is not request:  # a reused id is another request
            t = self._reqs[request.request_id] = _Tracked(request)
        return t

    def _hashes(self, t: _Tracked, num_blocks: int) -> list[bytes]:
        if len(t.hashes) < num_blocks:
            req, bs = t.request, self.block_size
            t.hashes.extend(hash_request_tokens(
                bs, req.all_token_ids[:num_blocks * bs], cache_salt=getattr(req, "cache_salt", None),
                parent_hash=t.hashes[-1] if t.hashes else None, start_block=len(t.hashes)))
        return t.hashes

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
        keys = [self.key(h) for h in self._hashes(t, end)[start:end]]
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

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        t = self._track(request)
        n = -(-num_external_tokens // self.block_size)  # a partial block counts (P/D)
        if n:
            ids = list(blocks)[t.fetch_start:t.fetch_start + n]
            self._pending_loads[request.request_id] = list(zip(ids, t.fetched[:n]))
            self.stats.external_hit_tokens += num_external_tokens
        # Blocks before this point are already in the store (loaded) or were
        # computed and saved by this engine earlier (local hits).
        t.num_saved_blocks = max(t.num_saved_blocks,
                                 (t.fetch_start * self.block_size + num_external_tokens) // self.block_size)
        t.fetched = []

    def build_connector_meta(self, scheduler_output) -> GlobalCacheMetadata:
        """Called after the scheduler advanced `num_computed_tokens` for this step."""
        so = scheduler_output
        meta = GlobalCacheMetadata()
        for nr in so.scheduled_new_reqs:
            t = self._reqs.get(nr.req_id)
            if t is not None:
                t.block_ids = list(nr.block_ids)
        for cr in so.scheduled_cached_reqs:
            t = self._reqs.get(cr.req_id)
            if t is not None:
                if cr.resumed_from_preemption or cr.replace_block_ids:
                    t.block_ids = list(cr.new_block_ids)
                else:
                    t.block_ids.extend(cr.new_block_ids)
        for rid in list(self._pending_loads):
            if rid in so.num_scheduled_tokens:
                meta.loads.extend(self._pending_loads.pop(rid))
        if self.kv_transfer_config.is_kv_producer:
            for rid in so.num_scheduled_tokens:
                t = self._reqs.get(rid)
                if t is None:
                    continue
                req = t.request
                full = min(req.num_computed_tokens, req.num_tokens, len(t.block_ids) * self.block_size)
                full //= self.block_size
                if full > t.num_saved_blocks:
                    hashes = self._hashes(t, full)
                    meta.saves.extend((self.key(hashes[i]), t.block_ids[i])
                                      for i in range(t.num_saved_blocks, full))
                    t.num_saved_blocks = full
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        t = self._reqs.get(request.request_id)
        if t is not None and t.request is request:
            del self._reqs[request.request_id]
        self._pending_loads.pop(request.request_id, None)
        return False, None

    # =============================================================== worker
    def register_kv_caches(self, kv_caches) -> None:
        self._kv_caches = list(kv_caches)

    def start_load_kv(self, forward_context=None) -> None:
        meta = self._connector_metadata
        if meta is None or not meta.loads:
            return
        dev = self._kv_caches[0][0].device
        ids = torch.tensor([b for b, _ in meta.loads], dtype=torch.long, device=dev)
        data = torch.stack([x for _, x in meta.loads]).to(dev)  # [n, layers, 2, bs, h, d]
        for layer, (k, v) in enumerate(self._kv_caches):
            k.index_copy_(0, ids, data[:, layer, 0])
            v.index_copy_(0, ids, data[:, layer, 1])
        self.stats.blocks_loaded += len(meta.loads)
        self.stats.bytes_loaded += len(meta.loads) * self.layout.block_nbytes

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # start_load_kv already wrote every layer

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata=None) -> None:
        pass  # a value holds all layers of a block: wait_for_save gathers them at once

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if meta is None or not meta.saves or self.saver is None:
            return
        dev = self._kv_caches[0][0].device
        ids = torch.tensor([b for _, b in meta.saves], dtype=torch.long, device=dev)
        # [n, layers, 2, bs, h, d]: one copy off the paged cache, then the block
        # ids may be reused by the scheduler while the saver thread works.
        blocks = torch.stack([torch.stack([k.index_select(0, ids), v.index_select(0, ids)], 1)
                              for k, v in self._kv_caches], 1).cpu()
        self.saver.submit([(key, self.pack_block(key, blocks[i])) for i, (key, _) in enumerate(meta.saves)])

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait (bounded) until queued saves reached the store; True when they did."""
        return self.saver.flush(timeout_s) if self.saver is not None else True

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
