"""A KV block as bytes: header, payload (all layers' K and V), checksum.

vLLM counterpart: none in vLLM itself; LMCache's serializers
(`lmcache/v1/memory_management.py`, `storage_backend/`) and Mooncake Store's
objects play this part.

Layout (little-endian):
    magic b"MVKV" | u16 version | u16 dtype code | 32-byte sha256 of the key
    | u64 payload length | payload | 16-byte blake2b of everything before it
The key digest makes a value stored under another key (a foreign or
misplaced value) a miss; the length catches truncation; the checksum catches
flipped bytes. Invariant: `unpack_block` returns a tensor only when all three
checks pass; otherwise it raises `CorruptBlockError` and nothing is loaded.
"""
from __future__ import annotations

import hashlib
import struct

import torch

from .layout import KVLayout
from .store import CorruptBlockError

MAGIC = b"MVKV"
VERSION = 1
_HEADER = struct.Struct("<4sHH32sQ")
_SUM = 16
# The header's dtype code: an fp8 block (kv_cache_dtype "fp8_e4m3" / "fp8_e5m2") records its
# format, so a block of another format or precision is refused (CorruptBlockError) before use.
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4,
               torch.float8_e5m2: 5}


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def pack_block(key: str, block: torch.Tensor) -> bytes:
    """`block`: one block's KV, [layers, 2, block_size, kv_heads, head_dim], on CPU."""
    if block.dtype not in DTYPE_CODES:
        raise ValueError(f"block dtype must be one of {list(DTYPE_CODES)}, got {block.dtype}")
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    head = _HEADER.pack(MAGIC, VERSION, DTYPE_CODES[block.dtype], _key_digest(key), len(payload))
    body = head + payload
    return body + hashlib.blake2b(body, digest_size=_SUM).digest()


def unpack_block(key: str, data: bytes, layout: KVLayout) -> torch.Tensor:
    """The block tensor stored in `data` under `key`, or CorruptBlockError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptBlockError(f"value of {key} is {type(data).__name__}, not bytes")
    expect = layout.block_nbytes
    if len(data) != _HEADER.size + expect + _SUM:
        raise CorruptBlockError(f"value of {key} has {len(data)} bytes, expected "
                                f"{_HEADER.size + expect + _SUM} (truncated or another layout)")
    magic, version, code, digest, n = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlockError(f"value of {key}: bad magic/version {magic!r}/{version}")
    if code != DTYPE_CODES[layout.torch_dtype] or n != expect:
        names = {c: str(d).removeprefix("torch.") for d, c in DTYPE_CODES.items()}
        raise CorruptBlockError(f"value of {key}: dtype code {code} ({names.get(code, 'unknown')}) / length {n} "
                                f"do not match the layout ({layout.dtype}, {expect} bytes)")
    if digest != _key_digest(key):
        raise CorruptBlockError(f"value of {key} was written for another key (foreign value)")
    mv = memoryview(data)  # no copies until the one writable buffer the tensor needs
    if hashlib.blake2b(mv[:-_SUM], digest_size=_SUM).digest() != bytes(mv[-_SUM:]):
        raise CorruptBlockError(f"value of {key}: checksum mismatch (corrupted bytes)")
    raw = torch.frombuffer(bytearray(mv[_HEADER.size:-_SUM]), dtype=torch.uint8)
    return raw.view(layout.torch_dtype).reshape(layout.block_shape)
