"""Chapter 2 mutants: classic KV-cache-manager mistakes planted in the reference.

Each must make `tests/test_ch2_*.py` fail; the hand-built examples run first
so the first failure names the mistake.
"""
from mutants.core import Mutant

TESTS = [
    "tests/test_ch2_examples.py",
    "tests/test_ch2_manager.py",
    "tests/test_ch2_block_pool.py",
    "tests/test_ch2_hashing.py",
    "tests/test_ch2_free_queue.py",
    "tests/test_ch2_regressions.py",
    "tests/test_ch2_stateful.py",
]
MANAGER = "02_kvcache/kv_cache_manager.py"
MANAGER_BASE = "02_kvcache/kv_cache_manager_base.py"  # given to the exercise
POOL = "02_kvcache/block_pool.py"
HASH = "02_kvcache/block_hash.py"
CHAIN = "02_kvcache/block_hash_chain.py"  # given to the exercise
QUEUE = "02_kvcache/kv_cache_utils.py"

MUTANTS: list[Mutant] = [
    Mutant(
        name="lookup_continue_after_miss",
        path=MANAGER,
        old="            if block is None:\n                break\n",
        new="            if block is None:\n                continue\n",
        tests=TESTS,
        why="prefix lookup skips a missing block and keeps matching: KV without its prefix",
    ),
    Mutant(
        name="last_prompt_token_hits",
        path=MANAGER,
        old="max_blocks = max(request.num_tokens - 1, 0) // self.block_size",
        new="max_blocks = request.num_tokens // self.block_size",
        tests=TESTS,
        why="a fully cached prompt hits every token, so nothing is left to produce logits",
    ),
    Mutant(
        name="hash_without_parent",
        path=HASH,
        old="data = parent_hash + _pack(",
        new="data = _pack(",
        tests=TESTS,
        why="parent hash left out of the block hash: equal blocks at different positions collide",
    ),
    Mutant(
        name="chain_restarts_every_block",
        path=CHAIN,
        old="prev = hash_fn(prev, token_ids[",
        new="prev = hash_fn(None, token_ids[",
        tests=TESTS,
        why="the request's chain hashes every block from the root instead of from its parent",
    ),
    Mutant(
        name="hash_without_salt",
        path=CHAIN,
        old="extra = (cache_salt,) if (i == 0 and cache_salt is not None) else None",
        new="extra = None",
        tests=TESTS,
        why="cache_salt never reaches the hash: tenants share (and can probe) each other's prefixes",
    ),
    Mutant(
        name="python_hash_not_sha256",
        path=HASH,
        old="return _sha256(data).digest()",
        new="return hash(data).to_bytes(8, 'little', signed=True) * 4",
        tests=TESTS,
        why="Python's hash() is salted per process: hashes disagree across processes and machines",
    ),
    Mutant(
        name="probe_counts_stats",
        path=MANAGER,
        old="        if record_stats:\n",
        new="        if True:\n",
        tests=TESTS,
        why="a probe lookup (record_stats=False) is counted: a request looked up every step inflates the hit rate",
    ),
    Mutant(
        name="head_first_free",
        path=MANAGER,
        old="self.block_pool.free_blocks(reversed(blocks))",
        new="self.block_pool.free_blocks(blocks)",
        tests=TESTS,
        why="free head first: a request's head is evicted before its tail, orphaning the chain",
    ),
    Mutant(
        name="touch_leaves_block_queued",
        path=POOL,
        old="            if block.ref_cnt == 0:\n                self.free_block_queue.remove(block)\n",
        new="",
        tests=TESTS,
        why="a prefix hit on a free block stays in the free queue and can be evicted while in use",
    ),
    Mutant(
        name="touch_only_free_blocks",
        path=POOL,
        old="                self.free_block_queue.remove(block)\n            block.ref_cnt += 1",
        new="                self.free_block_queue.remove(block)\n                block.ref_cnt += 1",
        tests=TESTS,
        why="touch counts a reference only for free blocks: a shared block is freed under its other holder",
    ),
    Mutant(
        name="free_queues_block_in_use",
        path=POOL,
        old="            if block.ref_cnt == 0:\n                self.free_block_queue.append(block)",
        new="            if True:\n                self.free_block_queue.append(block)",
        tests=TESTS,
        why="free_blocks queues a block another request still holds: it is evicted under that request",
    ),
    Mutant(
        name="eviction_keeps_hash",
        path=POOL,
        old="            self._maybe_evict_cached_block(block)\n",
        new="",
        tests=TESTS,
        why="a block reused for new tokens keeps its old hash: a later lookup reads the wrong KV",
    ),
    Mutant(
        name="evict_leaves_map_entry",
        path=POOL,
        old="        self.cached_block_hash_to_block.pop(h, block.block_id)\n",
        new="",
        tests=TESTS,
        why="an evicted block stays in the hash map under its old hash: a lookup hits overwritten KV",
    ),
    Mutant(
        name="evict_keeps_block_hash",
        path=POOL,
        old="        block.reset_hash()\n        return True",
        new="        return True",
        tests=TESTS,
        why="an evicted block keeps its old hash: the map and the block disagree, re-caching it fails",
    ),
    Mutant(
        name="evict_drops_every_copy",
        path=POOL,
        old="self.cached_block_hash_to_block.pop(h, block.block_id)",
        new="self.cached_block_hash_to_block._cache.pop(h, None)",
        tests=TESTS,
        why="evicting one block drops every block cached under its hash: the other copies stop hitting",
    ),
    Mutant(
        name="evict_most_recently_freed",
        path=QUEUE,
        old="first = self._head.next_free_block\n        if first is self._tail:",
        new="first = self._tail.prev_free_block\n        if first is self._head:",
        tests=TESTS,
        why="eviction pops the tail (MRU) of the free queue instead of the head (LRU)",
    ),
    Mutant(
        name="self_eviction_of_hits",
        path=MANAGER_BASE,
        old="self.num_free_blocks - num_evictable_hits",
        new="self.num_free_blocks",
        tests=TESTS,
        why="hit blocks still in the free queue counted as free: the request evicts its own hits",
    ),
    Mutant(
        name="no_copy_on_write",
        path=MANAGER_BASE,
        old="if blocks[i].ref_cnt > 1]",
        new="if blocks[i].ref_cnt > 2]",
        tests=TESTS,
        why="a block shared by two forks is written in place: one sample overwrites the other's KV",
    ),
]
