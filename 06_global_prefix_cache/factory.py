"""Build connectors and stores from `kv_transfer_config`.

vLLM counterpart: `vllm/distributed/kv_transfer/kv_connector/factory.py`
(`KVConnectorFactory.create_connector(config, role)`) and the worker-side
`ensure_kv_transfer_initialized` in `kv_transfer_state.py`.

The engine imports this module only when `kv_transfer_config` is set, so
Chapters 1-5 never depend on Chapter 6. `build_connectors` returns the two
instances an engine needs (scheduler role, worker role); they share one store
client, as the two processes of a vLLM deployment would share one server.
"""
from __future__ import annotations

import importlib

from .base import KVConnectorRole
from .config import KVTransferConfig
from .connector import GlobalCacheConnector
from .layout import KVLayout, model_content_id
from .stats import ConnectorStats
from .store import KVStore


def make_store(tc: KVTransferConfig) -> KVStore:
    ex = tc.extra
    if ex["backend"] == "local":
        from .local_pool import get_local_pool
        return get_local_pool(ex["pool_name"], int(ex["capacity_bytes"]))
    if ex["backend"] == "valkey":
        from .valkey_store import ValkeyStore
        return ValkeyStore(ex["url"], ex["timeout_s"], ex["retry_interval_s"])
    if ex["backend"] == "p2p":
        from .p2p_store import P2PStore
        return P2PStore(ex["url"], ex["p2p_rank"], int(ex["capacity_bytes"]))
    from .mooncake_store import MooncakeStore
    return MooncakeStore(ex["url"], ex["metadata_server"], int(ex["capacity_bytes"]))


def layout_for(config, model_config, tp_rank: int = 0, model_id: str | None = None) -> KVLayout:
    mc = model_config
    return KVLayout(model_id=model_id or model_content_id(config.model),
                    dtype=str(config.kv_cache_torch_dtype).removeprefix("torch."),  # fp8 when kv_cache_dtype is
                    block_size=config.block_size, num_layers=mc.num_hidden_layers,
                    num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim, tp_rank=tp_rank)


class KVConnectorFactory:
    @staticmethod
    def create_connector(kv_transfer_config, role: KVConnectorRole, layout: KVLayout,
                         store: KVStore | None = None, stats=None) -> GlobalCacheConnector:
        tc = KVTransferConfig.from_dict(kv_transfer_config)
        cls = GlobalCacheConnector
        if tc.kv_connector_module_path is not None:
            cls = KVConnectorFactory._class_from_module(tc)
        elif tc.kv_connector == "PDConnector":
            from .pd_connector import PDConnector as cls
        return cls(tc, role, layout, store if store is not None else make_store(tc), stats)

    @staticmethod
    def _class_from_module(tc: KVTransferConfig) -> type:
        """vLLM's `kv_connector_module_path`: the class named `kv_connector` in that module."""
        try:
            module = importlib.import_module(tc.kv_connector_module_path)
        except ImportError as e:
            raise ValueError(f"kv_connector_module_path {tc.kv_connector_module_path!r} cannot be "
                             f"imported: {e}") from e
        cls = getattr(module, tc.kv_connector, None)
        if not isinstance(cls, type):
            raise ValueError(f"kv_connector_module_path {tc.kv_connector_module_path!r} has no class "
                             f"{tc.kv_connector!r}")
        return cls


def build_connectors(config, model_config) -> tuple[GlobalCacheConnector, GlobalCacheConnector]:
    """(scheduler-side, worker-side) connectors for an engine, built before its
    worker: the engine core keeps the first and hands the second to its
    executor, whose worker registers its KV tensors with it once they exist."""
    tc = KVTransferConfig.from_dict(config.kv_transfer_config)
    layout = layout_for(config, model_config, tc.extra["tp_rank"], tc.extra["model_id"])
    store = make_store(tc)
    stats = ConnectorStats()  # one set of counters for the engine's two instances
    sched = KVConnectorFactory.create_connector(tc, KVConnectorRole.SCHEDULER, layout, store, stats)
    work = KVConnectorFactory.create_connector(tc, KVConnectorRole.WORKER, layout, store, stats)
    return sched, work
