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


_CONTENT_IDS: dict[tuple, str] = {}


def model_content_id(path: str) -> str:
    """A fingerprint of a model folder's content: config.json and every weight
    file, hashed whole (blake2b, about 1 GB/s; a fine-tune may change only a
    few tensors in the middle of a file). Cached per process by path, size and
    modification time, so several engines in one process hash once."""
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    files = [n for n in names if n == "config.json" or n.endswith((".safetensors", ".bin", ".pt"))]
    sig = tuple((n, os.path.getsize(os.path.join(path, n)), os.path.getmtime(os.path.join(path, n)))
                for n in files)
    cache_key = (os.path.abspath(path), sig)
    if cache_key in _CONTENT_IDS:
        return _CONTENT_IDS[cache_key]
    h = hashlib.blake2b(digest_size=16)
    for name in files:
        h.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    if not files:
        h.update(str(path).encode())
    out = _CONTENT_IDS[cache_key] = h.hexdigest()
    return out


def block_key(prefix: str, fingerprint: str, block_hash: bytes) -> str:
    return f"{prefix}:{fingerprint[:32]}:{block_hash.hex()}"
