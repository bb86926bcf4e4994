"""Store keys of KV blocks: Chapter 2's chain hash + a fingerprint of the KV layout.

vLLM counterpart: the cache-key logic of LMCache (`CacheEngineKey`: model
name, world size, worker id, chunk hash) that `lmcache_connector.py` relies
on, and `MooncakeStoreConnector`'s key scheme (`mooncake_connector.py`).

A block's key must change whenever its KV bytes could:
* the tokens and everything before them, plus the cache salt (tenant):
  Chapter 2's chain hash already covers these;
* the model (its content, not its path: two machines mount it at different
  paths), dtype, block size, layer count, KV heads, head dim and the
  tensor-parallel rank (each rank holds other heads): the fingerprint.
Invariant: equal keys imply byte-identical KV for a deterministic model.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's value: [layers, K/V, block_size, kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    def fingerprint(self) -> str:
        """Hex sha256 of every layout field (canonical JSON, sorted keys)."""
        raw = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(raw).hexdigest()


def model_content_id(path: str, sample_bytes: int = 1 << 20) -> str:
    """A fingerprint of a model folder's content: config.json, plus each weight
    file's size and its first and last `sample_bytes` bytes (hashing a multi-GB
    file whole would slow engine start; a retrained model changes these)."""
    h = hashlib.sha256()
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    for name in names:
        full = os.path.join(path, name)
        if name == "config.json":
            with open(full, "rb") as f:
                h.update(b"config" + f.read())
        elif name.endswith((".safetensors", ".bin", ".pt")):
            size = os.path.getsize(full)
            h.update(name.encode() + size.to_bytes(8, "little"))
            with open(full, "rb") as f:
                h.update(f.read(sample_bytes))
                f.seek(max(0, size - sample_bytes))
                h.update(f.read(sample_bytes))
    if not names:
        h.update(str(path).encode())
    return h.hexdigest()[:32]


def block_key(prefix: str, fingerprint: str, block_hash: bytes) -> str:
    return f"{prefix}:{fingerprint[:32]}:{block_hash.hex()}"
