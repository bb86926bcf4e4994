"""The given half of `GlobalCacheConnector`: request tracking, allocation,
per-step metadata and the worker side, around three pluggable pieces.

vLLM counterparts: `vllm/distributed/kv_transfer/kv_connector/v1/
lmcache_connector.py` and `mooncake_connector.py` (a store-backed connector),
with the interface of `base.py` in this chapter.

The lesson of the chapter is not in this file: the store keys
(`block_keys`), the block format (`pack_block` / `unpack_block`) and the
matching (`get_num_new_matched_tokens`) are set by a subclass:
`connector.GlobalCacheConnector` (the reference) or the exercise's class.

Scheduler side (role SCHEDULER): `update_state_after_alloc` pairs the
blocks fetched at lookup (`_Tracked.fetched`, starting at block
`fetch_start`) with the block ids the scheduler allocated;
`build_connector_meta` hands those loads, plus the blocks that became full
this step (saves), to the worker side.
Worker side (role WORKER): `start_load_kv` writes all loads into every
layer before the forward pass (so `wait_for_layer_load` has nothing to wait
for); `wait_for_save` gathers the blocks to save from all layers after the
forward and queues them for the background saver (one value holds all layers
of a block, so per-layer `save_kv_layer` calls are not needed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mini_vllm.kernels.kv_cache_dtype import as_bytes

from .base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from .layout import KVLayout
from .stats import ConnectorStats

@dataclass
class GlobalCacheMetadata(KVConnectorMetadata):
    # (block id, verified block tensor [layers, 2, block_size, kv_heads, head_dim])
    loads: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    saves: list[tuple[str, int]] = field(default_factory=list)  # (store key, block id)


@dataclass
class _Tracked:
    request: object
    keys: list[str] = field(default_factory=list)  # store keys of its first full blocks
    block_ids: list[int] = field(default_factory=list)
    num_saved_blocks: int = 0
    # Blocks fetched by the last lookup: they start at block `fetch_start`.
    fetch_start: int = 0
    fetched: list[torch.Tensor] = field(default_factory=list)


class GlobalCacheConnectorBase(KVConnectorBase_V1):
    # The lesson's pieces, set by a subclass (staticmethod): `connector.GlobalCacheConnector`
    # sets the reference ones, the exercise the learner's.
    block_keys = None    # (prefix, layout, token_ids, cache_salt) -> one key per full block
    pack_block = None    # (key, block tensor) -> bytes
    unpack_block = None  # (key, bytes, layout) -> block tensor, or CorruptBlockError

    def __init__(self, kv_transfer_config, role: KVConnectorRole, layout: KVLayout, store,
                 stats: ConnectorStats | None = None) -> None:
        super().__init__(kv_transfer_config, role)
        self.layout, self.store = layout, store
        self.block_size = layout.block_size
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

    def keys_for(self, token_ids, cache_salt: str | None = None) -> list[str]:
        """Store keys of the full blocks of `token_ids` under this connector's layout."""
        return list(self.block_keys(self.key_prefix, self.layout, list(token_ids), cache_salt))

    # ============================================================ scheduler
    def _track(self, request) -> _Tracked:
        t = self._reqs.get(request.request_id)
        if t is None or t.request is not request:  # a reused id is another request
            t = self._reqs[request.request_id] = _Tracked(request)
        return t

    def _keys(self, t: _Tracked, num_blocks: int) -> list[str]:
        """The request's first `num_blocks` block keys (recomputed when it has more full blocks)."""
        if len(t.keys) < num_blocks:
            req = t.request
            t.keys = self.keys_for(req.all_token_ids[:num_blocks * self.block_size],
                                   getattr(req, "cache_salt", None))
        return t.keys

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
                    keys = self._keys(t, full)
                    meta.saves.extend((keys[i], t.block_ids[i])
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
            # bytes for an fp8 cache: torch has no CPU float8 index_copy_ (same bits either way)
            as_bytes(k).index_copy_(0, ids, as_bytes(data[:, layer, 0]))
            as_bytes(v).index_copy_(0, ids, as_bytes(data[:, layer, 1]))
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
