"""The KV connector interface: how an engine loads and saves KV blocks
from/to somewhere outside its own cache.

vLLM counterpart: `vllm/distributed/kv_transfer/kv_connector/v1/base.py`
(`KVConnectorBase_V1`, `KVConnectorRole`, `KVConnectorMetadata`). LMCache,
Mooncake and NIXL all plug into vLLM through this class.

One connector class, two instances per engine (as in vLLM):
* role SCHEDULER, called by the scheduler: how many tokens beyond the local
  prefix hit can come from outside (`get_num_new_matched_tokens`), which
  blocks were allocated for them (`update_state_after_alloc`), what to
  load/save this step (`build_connector_meta`), and a request's end
  (`request_finished`);
* role WORKER, called by the model runner around the forward pass:
  `start_load_kv` before it, `wait_for_layer_load` / `save_kv_layer` per
  layer, `wait_for_save` after it.
The only thing that travels from one side to the other is the metadata
object returned by `build_connector_meta`, attached to the SchedulerOutput,
so the two sides could live in different processes.

Invariants every implementation keeps:
* external tokens never include a request's last token (it must be computed
  to sample from it) and are a whole number of blocks, except for a P/D
  hand-off, which may end with a partial block (`pd_connector.py`);
* only full blocks are saved (Chapter 2's rule: a partial block's content
  still changes);
* after `start_load_kv` returns, every block the metadata asked to load holds
  its KV, or the scheduler was never told it would (no wrong or half load).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """Opaque per-step message from the scheduler-side connector to the worker side."""


class KVConnectorBase_V1(ABC):  # noqa: N801 (vLLM's name)
    def __init__(self, kv_transfer_config, role: KVConnectorRole) -> None:
        self.kv_transfer_config = kv_transfer_config
        self.role = role
        self._connector_metadata: KVConnectorMetadata | None = None

    # ------------------------------------------------------ worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches) -> None:
        """The runner's paged KV tensors: one (key_cache, value_cache) per layer."""

    @abstractmethod
    def start_load_kv(self, forward_context=None) -> None:
        """Begin (or do) the loads of this step; called before the forward pass."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer `layer_name`'s loads are in its KV cache."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata=None) -> None:
        """Begin saving layer `layer_name`'s blocks of this step."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Called once the forward pass is done; must return within a bounded time."""

    # --------------------------------------------------- scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens beyond `num_computed_tokens` available outside, load asynchronously?)."""

    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """`blocks`: the request's block ids after allocation (local hits first)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """What the worker side must load and save in this step; resets per-step state."""

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        """(delay freeing the blocks?, kv_transfer_params for the client)."""
        return False, None
