"""The given half of the KV cache manager: per-request block lists on top of the block pool.

vLLM counterpart: `vllm/v1/core/kv_cache_manager.py` (`KVCacheManager`), with
the single-attention-type logic of `vllm/v1/core/single_type_kv_cache_manager.py`
folded in. Copy-on-write `fork` comes from the vLLM paper/thesis (seed 001
§3.4.4), which vLLM v0's block manager implemented.

Requests are duck-typed: only `request_id`, `all_token_ids`,
`num_prompt_tokens`, `num_tokens`, `num_computed_tokens` and `cache_salt` are
read.

Invariants
----------
* `_req_blocks[r]` lists request r's blocks in logical order; every block in
  it has `ref_cnt >= 1`, and a block's `ref_cnt` equals the number of request
  lists that contain it.
* `_req_block_hashes[r][i]` is the hash of r's i-th *full* block of tokens,
  computed from the request object `_hash_owner[r]`; a different object
  arriving under the same id (a server reuses ids, and a request may be
  looked up and dropped without `free`) starts a fresh list, so it never
  hits on another request's blocks. vLLM keeps the list on the request
  itself (`Request.block_hashes`); here the manager keeps it, keyed by id and
  checked by identity, so any duck-typed request works.
  `_num_cached_blocks[r]` blocks at the head of r's list carry exactly those
  hashes.
* A block holding tokens that are not yet full is never hashed; lookahead
  (speculative) slots are never hashed.
* `allocate_slots` either succeeds completely or returns None with no change.
* A block shared by several requests (ref_cnt > 1) is never written: the
  writer gets a private copy first (copy-on-write), recorded for the runner.
"""
from __future__ import annotations

from typing import Any, Callable

from .block_pool_base import BlockPoolBase
from .kv_cache_utils import KVCacheBlock, cdiv
from .stats import PrefixCacheStats


class KVCacheManagerBase:
    #: Set by the subclass: the pool class (with the lesson's allocation, touch
    #: and free) and the hash chain (with the lesson's one-block hash).
    block_pool_cls: type[BlockPoolBase]
    hash_request_tokens: Callable[..., list[bytes]]

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = self.block_pool_cls(num_blocks, enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_block_hashes: dict[str, list[bytes]] = {}
        self._hash_owner: dict[str, Any] = {}  # the request object each hash list belongs to
        self._num_cached_blocks: dict[str, int] = {}
        self._blocks_to_copy: list[tuple[int, int]] = []
        # Requests whose block list changed in place (copy-on-write) since the
        # last take: a runner holding their old table must get the new one.
        self._cow_request_ids: set[str] = set()

    # ---- views --------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self._req_blocks.get(request_id, ()))

    def take_cow_request_ids(self) -> set[str]:
        """Requests whose existing blocks were replaced by private copies since the last call."""
        out, self._cow_request_ids = self._cow_request_ids, set()
        return out

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """(src, dst) block copies owed to the runner since the last call."""
        out, self._blocks_to_copy = self._blocks_to_copy, []
        return out

    # ---- hashing --------------------------------------------------------------
    def _block_hashes(self, request: Any, num_full_blocks: int) -> list[bytes]:
        """The request's block-hash list, extended to cover `num_full_blocks` blocks."""
        rid = request.request_id
        if self._hash_owner.get(rid) is not request:
            # Hashes come from one request object's tokens; another object
            # under a reused id may hold other tokens, so start over.
            self._hash_owner[rid] = request
            self._req_block_hashes[rid] = []
        hashes = self._req_block_hashes[rid]
        if len(hashes) < num_full_blocks:
            hashes.extend(self.hash_request_tokens(
                self.block_size, request.all_token_ids[:num_full_blocks * self.block_size],
                cache_salt=request.cache_salt,
                parent_hash=hashes[-1] if hashes else None, start_block=len(hashes)))
        return hashes

    # ---- allocation ---------------------------------------------------------------
    def allocate_slots(self, request: Any, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for `num_computed_tokens + num_new_computed_tokens +
        num_new_tokens + num_lookahead_tokens` tokens.

        Returns the newly appended blocks (possibly []), or None, with nothing
        changed, when the free blocks do not suffice. Copy-on-write replacements
        are not in the returned list; they show up in `get_block_ids` and in
        `take_blocks_to_copy`.
        """
        if (num_new_computed_tokens == 0 and num_lookahead_tokens == 0 and not new_computed_blocks
                and type(num_new_tokens) is int and num_new_tokens >= 0
                and self._needs_nothing(request, num_new_tokens)):
            return []
        for name, v in (("num_new_tokens", num_new_tokens),
                        ("num_new_computed_tokens", num_new_computed_tokens),
                        ("num_lookahead_tokens", num_lookahead_tokens)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        new_computed_blocks = list(new_computed_blocks or ())
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens must be len(new_computed_blocks) * block_size "
                f"= {len(new_computed_blocks) * self.block_size}, got {num_new_computed_tokens}")
        rid = request.request_id
        blocks = self._req_blocks.get(rid, [])
        if new_computed_blocks and (blocks or request.num_computed_tokens):
            raise ValueError("new_computed_blocks are only accepted for a request that "
                             "holds no blocks and has num_computed_tokens == 0")

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens + num_lookahead_tokens
        num_required = cdiv(num_total, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))

        # Copy-on-write: existing blocks that this step writes into and that
        # another request also holds.
        cow = [i for i in range(num_computed // self.block_size, min(num_required, len(blocks)))
               if blocks[i].ref_cnt > 1] if num_total > num_computed else []

        # Hit blocks sitting in the free queue are counted as free, but we are
        # about to take them, so they cannot also serve as new blocks (that
        # would evict the request's own hits).
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + len(cow) > self.num_free_blocks - num_evictable_hits:
            return None

        # ---- commit: nothing below may fail -----------------------------------
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
        blocks = self._req_blocks.setdefault(rid, blocks)
        blocks.extend(new_computed_blocks)
        if new_computed_blocks:
            self._num_cached_blocks[rid] = len(new_computed_blocks)

        if cow:
            self._cow_request_ids.add(rid)
        for i in cow:
            old = blocks[i]
            (new,) = self.block_pool.get_new_blocks(1)
            if i * self.block_size < num_computed:  # it holds tokens we must keep
                self._blocks_to_copy.append((old.block_id, new.block_id))
            blocks[i] = new
            self.block_pool.free_blocks([old])  # others still hold it: ref_cnt stays > 0

        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)

        if self.enable_caching:
            num_known = min(num_computed + num_new_tokens, request.num_tokens)
            num_full = num_known // self.block_size
            num_cached = self._num_cached_blocks.get(rid, 0)
            if num_full > num_cached:
                hashes = self._block_hashes(request, num_full)
                self.block_pool.cache_full_blocks(blocks, hashes, num_cached, num_full)
                self._num_cached_blocks[rid] = num_full
        return new_blocks

    def _needs_nothing(self, request: Any, num_new_tokens: int) -> bool:
        """True when the step fits in the request's own, unshared blocks and
        fills none of them: the common decode step, where `allocate_slots`
        has nothing to do. It runs once per running request per step, so it
        skips the general path's validation and list building.
        """
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return False
        bs = self.block_size
        num_computed = request.num_computed_tokens
        end = num_computed + num_new_tokens
        if end > len(blocks) * bs:
            return False  # a new block is needed
        for i in range(num_computed // bs, -(-end // bs)):
            if blocks[i].ref_cnt > 1:
                return False  # copy-on-write first
        if self.enable_caching:
            num_full = min(end, request.num_tokens) // bs
            if num_full > self._num_cached_blocks.get(request.request_id, 0):
                return False  # a block became full: hash and cache it
        return True

    # ---- release / share ------------------------------------------------------------
    def _pop_request_state(self, request_id: str) -> list[KVCacheBlock] | None:
        """Forget everything kept for `request_id` (its hash list too); return
        its blocks in logical order, or None if it holds none."""
        self._req_block_hashes.pop(request_id, None)
        self._hash_owner.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        return self._req_blocks.pop(request_id, None)

    def fork(self, parent_request: Any, child_request: Any) -> None:
        """Let the child share every block of the parent (ref counts + 1).

        The child must be new to the manager and is expected to hold the same
        tokens as the parent (`num_computed_tokens` included). The first write
        into a shared, partially filled block copies it (`allocate_slots`).
        """
        pid, cid = parent_request.request_id, child_request.request_id
        if cid in self._req_blocks:
            raise ValueError(f"child request {cid!r} already holds blocks")
        parent_blocks = self._req_blocks.get(pid, [])
        self.block_pool.touch(parent_blocks)
        self._req_blocks[cid] = list(parent_blocks)
        self._req_block_hashes[cid] = list(self._req_block_hashes.get(pid, ()))
        self._hash_owner[cid] = child_request
        self._num_cached_blocks[cid] = self._num_cached_blocks.get(pid, 0)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()
