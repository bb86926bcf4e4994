"""The hash chain over a request's full blocks, around a pluggable one-block hash.

vLLM counterpart: `NONE_HASH` and `hash_request_tokens` in
`vllm/v1/core/kv_cache_utils.py` (vLLM now builds the same chain
incrementally with `get_request_block_hasher`).

The chain is the given plumbing of the chapter; the hash of one block, the
lesson, is `block_hash.hash_block_tokens` in the reference and the learner's
own function in `exercise.py`. Each binds its hash here, so this module holds
no answer and the exercise can import it.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Sequence

#: Seed "parent" of the first block of every request: sha256 of a fixed,
#: documented string, so every process and machine agrees on it.
NONE_HASH: bytes = hashlib.sha256(b"mini-vllm/kvcache/NONE_HASH/v1").digest()

#: hash_fn(parent_hash or None, this block's token ids, extra keys or None) -> 32 bytes.
BlockHashFn = Callable[[bytes | None, Sequence[int], Sequence[str] | None], bytes]


def hash_block_chain(hash_fn: BlockHashFn, block_size: int, token_ids: Sequence[int],
                     cache_salt: str | None = None,
                     parent_hash: bytes | None = None,
                     start_block: int = 0) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` (a trailing partial block is skipped).

    `parent_hash` / `start_block` continue an existing chain: block
    `start_block` is hashed with `parent_hash` as parent. The salt is applied
    only to block 0 (every later hash chains from it).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start_block < 0:
        raise ValueError(f"start_block must be >= 0, got {start_block}")
    if start_block > 0 and parent_hash is None:
        raise ValueError("parent_hash is required when start_block > 0 (it is block "
                         "start_block - 1's hash)")
    hashes = []
    prev = parent_hash
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        extra = (cache_salt,) if (i == 0 and cache_salt is not None) else None
        prev = hash_fn(prev, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(prev)
    return hashes
