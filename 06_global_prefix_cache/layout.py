"""What a KV block holds: its layout, and the identity of the model that wrote it.

vLLM counterpart: the fields LMCache's `CacheEngineKey` and
`MooncakeStoreConnector` carry beside a block's hash (model name, world size,
worker id, dtype); in vLLM they come from `ModelConfig` / `CacheConfig`.

`KVLayout` says how one block's value is shaped (its bytes depend on every
field); `model_content_id` names a model by its files' content, not its path
(two machines mount a model at different paths). How these become store keys
is `keys.py`; how a block becomes bytes is `serde.py`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

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
