"""Content hashes of full KV blocks, chained from the first block.

vLLM counterpart: `hash_block_tokens` / `hash_request_tokens` and `NONE_HASH`
in `vllm/v1/core/kv_cache_utils.py`. The chain over a request's blocks and
`NONE_HASH` live in `block_hash_chain.py` (given to the exercise); this file
holds the hash of one block and binds it into the chain.

A block's hash covers its parent's hash, its own token ids and optional extra
keys, so equal hashes mean equal *prefixes*, not just equal block contents: the
KV of a token depends on every token before it (seed 004 makes this point with
two sequences that share a block of tokens at different positions).

We use sha256 over a fixed byte encoding, never Python's `hash()`: `hash()` is
salted per process (PYTHONHASHSEED), and Chapter 6 compares hashes across
processes and machines.

Encoding of one block (all integers little-endian, so it is the same on every
machine):
    parent_hash (32 bytes) | u32 number of tokens | i64 per token
    | for each extra key: b"S" | u32 byte length | utf-8 bytes
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

from .block_hash_chain import NONE_HASH, hash_block_chain

_sha256 = hashlib.sha256
_pack = struct.pack


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: Sequence[str] | None = None) -> bytes:
    """sha256 digest (32 bytes) of one block chained onto `parent_hash`.

    `parent_hash=None` means "first block" and uses `NONE_HASH`. `extra_keys`
    are strings mixed into this block only (the request's `cache_salt` goes into
    the first block, which is enough: every later hash chains from it).
    """
    if parent_hash is None:
        parent_hash = NONE_HASH
    n = len(token_ids)
    data = parent_hash + _pack(f"<I{n}q", n, *token_ids)
    if extra_keys:
        for key in extra_keys:
            raw = key.encode("utf-8")
            data += b"S" + _pack("<I", len(raw)) + raw
    return _sha256(data).digest()


def hash_request_tokens(block_size: int, token_ids: Sequence[int],
                        cache_salt: str | None = None,
                        parent_hash: bytes | None = None,
                        start_block: int = 0) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` (a trailing partial block is skipped).

    The chain of `block_hash_chain.hash_block_chain` with `hash_block_tokens`
    as its link: `parent_hash` / `start_block` continue an existing chain, and
    the salt goes into block 0 only.
    """
    return hash_block_chain(hash_block_tokens, block_size, token_ids, cache_salt, parent_hash, start_block)
