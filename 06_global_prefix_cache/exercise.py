"""Chapter 6 exercise: write the connector's matching logic and the block format.

Run the chapter's tests against your code with
    .venv/bin/pytest -q tests/test_ch6_*.py --impl=exercise
Each test's message names the mistake it catches.

You write three pieces:
- `pack_block`: one KV block as bytes, with a header and a checksum;
- `unpack_block`: the inverse, which must refuse a corrupted, truncated or
  foreign value (raise `CorruptBlockError`) and never return wrong KV;
- `GlobalCacheConnector.get_num_new_matched_tokens`: how many tokens beyond
  the local prefix hit can be loaded from the store.

Given: the keys (`KVLayout`, `block_key`), the stores, and the rest of the
connector (`update_state_after_alloc`, `build_connector_meta`, the worker
side), which call your methods. The given class is a copy of the reference
*without* the method above, so a method you have not written raises instead
of quietly running the reference's answer.
vLLM counterparts: `vllm/distributed/kv_transfer/kv_connector/v1/base.py`,
`lmcache_connector.py`, `mooncake_connector.py`.
"""
from __future__ import annotations

from mini_vllm.paged_attention.exercise_support import given_class

import torch

from . import connector as _conn
from .base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole  # noqa: F401
from .config import KVTransferConfig  # noqa: F401
from .keys import KVLayout, block_key  # noqa: F401
from .local_pool import LocalLRUPool  # noqa: F401
from .serde import DTYPE_CODES, CorruptBlockError  # noqa: F401
from .stats import ConnectorStats  # noqa: F401
from .store import StoreUnavailable  # noqa: F401


_given = given_class  # a copy of the reference class without the lesson's methods


def pack_block(key: str, block: torch.Tensor) -> bytes:
    """TODO: `block` ([layers, 2, block_size, kv_heads, head_dim], on CPU) as bytes."""
    raise NotImplementedError(
        "pack_block: write a fixed-size header (a magic tag, a version, the dtype, a digest of "
        "`key`, the payload length), then the payload (block.contiguous().view(torch.uint8)"
        ".numpy().tobytes() keeps bfloat16 exact), then a checksum over header + payload "
        "(hashlib.blake2b(..., digest_size=16)). The key digest is what lets unpack_block "
        "refuse a value stored under another key.")


def unpack_block(key: str, data: bytes, layout: KVLayout) -> torch.Tensor:
    """TODO: the block stored in `data` under `key`, or raise CorruptBlockError."""
    raise NotImplementedError(
        "unpack_block: check, in this order, and raise CorruptBlockError on any failure: the "
        "total length (header + layout.block_nbytes + checksum; a truncated value must not "
        "raise struct.error or IndexError), the magic/version, the dtype and payload length "
        "against `layout`, the key digest against `key`, the checksum. Only then rebuild the "
        "tensor: torch.frombuffer(bytearray(payload), dtype=torch.uint8)"
        ".view(layout.torch_dtype).reshape(layout.block_shape).")


class GlobalCacheConnector(_given(_conn.GlobalCacheConnector, "get_num_new_matched_tokens", "_fetch")):
    pack_block = staticmethod(pack_block)
    unpack_block = staticmethod(unpack_block)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """TODO: (tokens beyond `num_computed_tokens` fetched and verified from the store, False)."""
        raise NotImplementedError(
            "get_num_new_matched_tokens: t = self._track(request) first (even for a kv_producer, "
            "which then returns (0, False): it never loads). Blocks start..end-1 are candidates, "
            "start = num_computed_tokens // block_size and end = (request.num_tokens - 1) // "
            "block_size (the last token is always computed). Keys: self.key(h) for h in "
            "self._hashes(t, end)[start:end]. One self.store.batch_get(keys); StoreUnavailable -> "
            "stats.store_errors += 1 and no match. Walk the values in order and stop at the first "
            "None or at the first value self.unpack_block rejects (stats.corrupt_blocks += 1): "
            "later blocks chain through it. Record what you fetched for update_state_after_alloc: "
            "t.fetched = the tensors, t.fetch_start = start. Count stats.lookups, "
            "stats.lookup_blocks and stats.hit_blocks. Return (len(fetched) * block_size, False).")
