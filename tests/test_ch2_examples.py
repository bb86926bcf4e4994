"""Chapter 2 by hand: one small, deterministic scenario per classic mistake.

The property and state-machine tests beside this file find these mistakes too,
but only after a random search and a shrink. Each test here builds the one
situation that exposes a single mistake and says which mistake it is, so a
wrong exercise fails in well under a second with a message naming the bug.
"""
import os
import subprocess
import sys

import pytest


def req(kv, rid, toks, salt=None):
    return kv.SimpleRequest(rid, list(toks), cache_salt=salt)


def run_prompt(m, r):
    """Look up the cached prefix, allocate the rest of the prompt, mark it computed."""
    hit, n_hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n_hit, n_hit, hit) is not None, \
        f"setup: request {r.request_id} must fit in the pool"
    r.num_computed_tokens = r.num_tokens
    return [b.block_id for b in hit]


def queue(m):
    """Free-queue block ids, head (evicted first) to tail."""
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def is_cached(m, toks, block_size, salt=None):
    return [m.block_pool.get_cached_block(h) is not None
            for h in m.hash_request_tokens(block_size, toks, cache_salt=salt)]


# ---- free queue: eviction, touch, tail-first free ----------------------------
def test_eviction_drops_the_hash(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=2, block_size=2)
    a = req(kv, "a", [1, 2, 3])
    run_prompt(m, a)
    m.free(a)
    run_prompt(m, req(kv, "b", [5, 6, 7]))  # both blocks: block 0 is evicted and rewritten
    assert not any(is_cached(m, [1, 2], 2)), (
        "a block reused for new tokens is still found under its old hash: eviction from the "
        "free queue must pop the hash-map entry and reset the block's hash")
    assert m.block_pool.blocks[0].block_hash in (None, m.hash_request_tokens(2, [5, 6])[0]), \
        "an evicted block must lose its old hash before it is cached again"


def test_evicting_a_cached_block_leaves_no_stale_entry(chapter):
    """`_maybe_evict_cached_block` alone, on blocks in the state `get_new_blocks`
    hands it (out of the free queue, ref_cnt 0), two of them cached under one hash."""
    kv = chapter("kvcache")
    pool = kv.BlockPool(3)
    a, b, c = pool.free_block_queue.popleft_n(3)
    h = bytes(range(32))  # any 32-byte key: this test does not depend on your hash_block_tokens
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)  # a second copy of the same prefix: the map is a multimap
    assert pool._maybe_evict_cached_block(c) is False and len(pool.cached_block_hash_to_block) == 1, \
        "a block that was never cached must be a no-op returning False"
    got = pool._maybe_evict_cached_block(a)
    held = pool.cached_block_hash_to_block[h] if h in pool.cached_block_hash_to_block else {}
    assert a.block_id not in held, (
        "stale hash-map entry: the evicted block is still in cached_block_hash_to_block under its old "
        "hash, so a later lookup hits a block whose KV is being overwritten")
    assert held == {b.block_id: b}, (
        f"evicting block {a.block_id} left {sorted(held)} under the hash, expected [{b.block_id}]: the "
        "other block cached under the same hash must stay (remove this block's entry, not the hash's)")
    assert a.block_hash is None, (
        "the evicted block keeps its old hash: block_hash must be cleared, or caching the block again "
        "raises and the map <=> block_hash invariant breaks")
    assert got is True, f"evicting a cached block returned {got!r}, expected True"
    assert pool._maybe_evict_cached_block(a) is False, "an already evicted block must be a no-op returning False"
    assert pool._maybe_evict_cached_block(b) is True and h not in pool.cached_block_hash_to_block, \
        "evicting the last block under a hash must leave no entry for that hash"
    assert [x.ref_cnt for x in (a, b, c)] == [0, 0, 0] and pool.get_num_free_blocks() == 0, \
        "eviction must leave reference counts and the free queue alone (get_new_blocks owns them)"


def test_eviction_is_least_recently_freed_first(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=4, block_size=2)
    a, b = req(kv, "a", [1, 2, 3]), req(kv, "b", [4, 5, 6])
    run_prompt(m, a)
    run_prompt(m, b)
    m.free(a)  # a's blocks are freed first, so they are evicted first
    m.free(b)
    run_prompt(m, req(kv, "c", [8, 8, 8]))  # takes 2 blocks
    assert is_cached(m, [1, 2], 2) == [False] and is_cached(m, [4, 5], 2) == [True], (
        "eviction took the most recently freed blocks: new blocks must come from the head of "
        "the free queue (least recently freed), which is LRU")


def test_touch_takes_a_hit_block_out_of_the_free_queue(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=4, block_size=2)
    a = req(kv, "a", [1, 2, 3])
    run_prompt(m, a)
    m.free(a)
    b = req(kv, "b", [1, 2, 5])
    assert run_prompt(m, b) == [0], "setup: b hits a's cached first block"
    assert 0 not in queue(m) and m.num_free_blocks == 2, (
        f"free queue {queue(m)} still holds block 0 that b now uses: touch must unlink a free "
        "block it hits, otherwise the next allocation can evict KV in use")
    c = req(kv, "c", [7, 7, 7])
    run_prompt(m, c)
    assert 0 not in m.get_block_ids("c"), "block 0 is in use by b and was handed to c"


def test_shared_block_stays_in_use_until_its_last_holder_frees_it(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=6, block_size=2)
    a, b = req(kv, "a", [1, 2, 3]), req(kv, "b", [1, 2, 4])
    run_prompt(m, a)
    assert run_prompt(m, b) == [0], "setup: b hits a's first block"
    shared = m.block_pool.blocks[0]
    assert shared.ref_cnt == 2, (
        f"a block hit by a second request has ref_cnt {shared.ref_cnt}, expected 2: touch must "
        "take a reference on a block already in use, not only on a free one")
    m.free(a)
    assert shared.ref_cnt == 1 and 0 not in queue(m), (
        "a block still held by b was put in the free queue: free_blocks may queue a block only "
        "when its ref_cnt drops to 0")
    m.free(b)
    assert shared.ref_cnt == 0 and queue(m).count(0) == 1, \
        "the last holder's free must queue the shared block exactly once"


def test_free_is_tail_first(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=4, block_size=2)
    a = req(kv, "a", range(6))
    run_prompt(m, a)
    assert m.get_block_ids("a") == [0, 1, 2] and queue(m) == [3], "setup: a holds blocks 0, 1, 2"
    m.free(a)
    assert queue(m) == [3, 2, 1, 0], (
        f"free queue after freeing a = {queue(m)}, expected [3, 2, 1, 0]: free must release a "
        "request's blocks tail first, so its tail is evicted before its head (head-first free "
        "evicts the head and orphans the rest of the chain)")
    run_prompt(m, req(kv, "b", [9, 9, 9]))  # 2 blocks: the unused one, then a's tail
    assert is_cached(m, range(6), 2) == [True, True, False], \
        "evicting for b must take a's tail block and keep its head cached"


def test_free_releases_every_block_once(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=6, block_size=2)
    a = req(kv, "a", range(5))
    run_prompt(m, a)
    m.free(a)
    assert m.num_free_blocks == 6 and sorted(queue(m)) == list(range(6)), \
        f"after freeing the only request every block must be free once, queue {queue(m)}"
    m.free(a)  # already freed: a no-op, never a double free
    assert m.num_free_blocks == 6 and m.get_block_ids("a") == [], \
        "freeing an already freed request must be a no-op, never a double free"


# ---- hash chain --------------------------------------------------------------
def test_parent_hash_is_part_of_the_chain(chapter):
    kv = chapter("kvcache")
    a = kv.hash_request_tokens(4, [1, 2, 3, 4, 5, 6, 7, 8])
    b = kv.hash_request_tokens(4, [9, 9, 9, 9, 5, 6, 7, 8])
    assert a[1] != b[1], (
        "parent hash left out of the chain: block [5, 6, 7, 8] hashed the same after "
        "[1, 2, 3, 4] and after [9, 9, 9, 9]; its KV differs, so its hash must chain "
        "through the parent's hash")
    assert kv.hash_block_tokens(a[0], [5, 6, 7, 8]) != kv.hash_block_tokens(None, [5, 6, 7, 8]), \
        "parent hash left out: hash_block_tokens ignores its parent_hash argument"


def test_same_tokens_at_another_position_do_not_hit(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=8, block_size=4)
    run_prompt(m, req(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    _, n = m.get_computed_blocks(req(kv, "b", [5, 6, 7, 8, 0]))
    assert n == 0, (
        f"block [5, 6, 7, 8] at position 0 hit {n} tokens cached at position 4: parent hash left "
        "out of the chain (the same tokens after another prefix are different KV)")


def test_hash_is_the_same_in_another_process(chapter):
    kv = chapter("kvcache")
    want = kv.hash_block_tokens(None, [1, 2, 3], ["s"]).hex()
    code = f"import {kv.__name__} as kv; print(kv.hash_block_tokens(None, [1, 2, 3], ['s']).hex())"
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=seed),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"the child process failed: {out.stderr[-1500:]}"
    assert out.stdout.strip() == want, (
        "the same block hashed differently in another process: Python's hash() is salted per "
        "process (PYTHONHASHSEED); hash a fixed byte encoding with sha256")


def test_cache_salt_isolates_tenants(chapter):
    kv = chapter("kvcache")
    toks = list(range(9))
    assert kv.hash_request_tokens(4, toks, "tenant-a")[0] != kv.hash_request_tokens(4, toks)[0], \
        "hash without salt: the cache_salt must be mixed into block 0's hash"
    m = kv.KVCacheManager(num_blocks=8, block_size=4)
    run_prompt(m, req(kv, "a", toks, salt="tenant-a"))
    for rid, salt in (("b", "tenant-b"), ("c", None)):
        _, n = m.get_computed_blocks(req(kv, rid, toks, salt=salt))
        assert n == 0, (f"hash without salt: salt {salt!r} hit {n} tokens cached under 'tenant-a'; "
                        "the salt must go into the first block's hash")
    _, n = m.get_computed_blocks(req(kv, "d", toks, salt="tenant-a"))
    assert n == 8, f"the same salt must hit its own 8 cached tokens, got {n}"


# ---- prefix lookup and allocation --------------------------------------------
def test_lookup_stops_at_first_miss_notebook_section_4(chapter):
    """The notebook's §4: block 0 of a 3-block prefix is evicted, blocks 1 and 2
    stay in the hash map. Reusing them would give the model KV for positions
    16-47 with nothing for 0-15."""
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=5, block_size=16)
    prefix = list(range(48))
    p = req(kv, "P", prefix + [1])
    run_prompt(m, p)
    # Free P head first, straight through the pool (the notebook's what-if), so
    # that this test does not depend on the manager's `free`.
    m.block_pool.free_blocks(m.get_blocks("P"))
    run_prompt(m, req(kv, "Q", range(500, 520)))  # 2 blocks: the unused one, then P's block 0
    assert is_cached(m, prefix, 16) == [False, True, True], \
        "setup: block 0 of the prefix should be evicted and blocks 1-2 still cached"
    hit, n = m.get_computed_blocks(req(kv, "R", prefix + [9]))
    assert (n, hit) == (0, []), (
        f"prefix lookup kept matching after a miss: {n} hit tokens (blocks "
        f"{[b.block_id for b in hit]}) where block 0 is not cached; stop at the first miss (break, "
        "not continue): a later block's KV is only valid after all the blocks before it")


def test_last_prompt_token_is_never_a_hit(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=8, block_size=4)
    run_prompt(m, req(kv, "a", range(8)))
    _, n = m.get_computed_blocks(req(kv, "b", range(8)))
    assert n == 4, (
        f"an 8-token prompt whose two blocks are cached returned {n} hit tokens, expected 4: "
        "the last prompt token must be recomputed (the model needs its logits), so at most "
        "(num_tokens - 1) // block_size blocks may hit")
    _, n = m.get_computed_blocks(req(kv, "c", range(4)))
    assert n == 0, f"a 4-token prompt equal to one cached block must hit 0 tokens, got {n}"


def test_refused_allocation_does_not_evict_its_own_hits(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=4, block_size=2)
    a = req(kv, "a", range(4))
    run_prompt(m, a)
    m.free(a)
    b = req(kv, "b", list(range(4)) + [7] * 5)
    hit, n = m.get_computed_blocks(b)
    assert n == 4, "setup: b hits a's 2 cached blocks"
    msg = ("b needs 5 blocks (2 hits + 3 new) from a pool of 4: its 2 hits sit in the free "
           "queue and were counted as free, so b would evict its own hits")
    try:
        got = m.allocate_slots(b, 5, n, hit)
    except ValueError as e:  # the pool ran dry half way: the check came too late
        pytest.fail(f"{msg} (allocate_slots raised instead of returning None: {e})")
    assert got is None, f"{msg}, yet allocation succeeded"
    assert all(x.ref_cnt == 0 for x in hit) and m.get_block_ids("b") == [], \
        "a refused allocation must change nothing"


def test_fork_copies_a_shared_block_before_writing_it(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=6, block_size=4)
    p = req(kv, "p", range(6))
    run_prompt(m, p)
    c = kv.SimpleRequest("c", list(range(6)), num_computed_tokens=6)
    m.fork(p, c)
    assert m.get_block_ids("c") == m.get_block_ids("p") == [0, 1], "setup: the fork shares both blocks"
    p.append_output_token(10)
    c.append_output_token(20)
    assert m.allocate_slots(c, 1) == [], "c's new token fits in its second block: copy-on-write appends nothing"
    assert m.get_block_ids("c")[1] != 1 and m.take_blocks_to_copy() == [(1, m.get_block_ids("c")[1])], (
        f"c wrote its token into block 1, still shared with p (c's table {m.get_block_ids('c')}): a "
        "block with ref_cnt > 1 must be copied (copy-on-write) before it is written")


@pytest.mark.parametrize("n_prompt", [3, 4])
def test_lookahead_slots_are_not_hashed(chapter, n_prompt):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(num_blocks=8, block_size=2)
    r = req(kv, "a", range(n_prompt))
    got = m.allocate_slots(r, n_prompt, num_lookahead_tokens=3)
    hashed = [m.block_pool.blocks[i].block_hash is not None for i in m.get_block_ids("a")]
    assert got is not None and hashed == [i < n_prompt // 2 for i in range(len(hashed))], (
        f"hashed blocks {hashed} for {n_prompt} prompt tokens + 3 lookahead slots: only blocks full "
        "of known tokens may be hashed, never draft (lookahead) positions")
