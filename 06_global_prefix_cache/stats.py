"""Counters of one connector (vLLM counterpart: `KVConnectorStats` in
`vllm/distributed/kv_transfer/kv_connector/v1/metrics.py`).

Invariant: every block that failed a check or could not be fetched is a miss
counted here, never loaded.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ConnectorStats:
    lookups: int = 0              # get_num_new_matched_tokens calls that asked the store
    lookup_blocks: int = 0        # blocks asked for
    hit_blocks: int = 0           # blocks found and verified at lookup
    external_hit_tokens: int = 0  # tokens admitted as external hits (update_state_after_alloc)
    blocks_loaded: int = 0        # blocks written into the paged KV cache
    bytes_loaded: int = 0
    corrupt_blocks: int = 0       # checksum, length, key or dtype mismatch: a miss
    store_errors: int = 0         # store down or timed out (lookups and saves)
    blocks_saved: int = 0
    bytes_saved: int = 0
    saves_failed: int = 0
    saves_dropped: int = 0        # dropped because the save queue was full

    def as_dict(self) -> dict:
        return asdict(self)
