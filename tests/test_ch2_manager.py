"""KVCacheManager behaviours: the vLLM-documented rules, one example each."""
import pytest


def req(kv, rid, toks, salt=None, computed=0):
    return kv.SimpleRequest(rid, list(toks), num_computed_tokens=computed, cache_salt=salt)


def run(m, r, n=None):
    """Look up, allocate the whole rest of the prompt, mark it computed."""
    hit, n_hit = m.get_computed_blocks(r)
    n = r.num_tokens - n_hit if n is None else n
    got = m.allocate_slots(r, n, n_hit, hit)
    if got is not None:
        r.num_computed_tokens = n_hit + n
    return hit, got


def free_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def test_prefix_hit_and_stats(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(10, 4)
    a = req(kv, "a", range(10))
    run(m, a)
    m.free(a)
    b = req(kv, "b", list(range(8)) + [50, 51])
    hit, n = m.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [0, 1] and n == 8, \
        f"b shares a's first 2 cached blocks, got blocks {[x.block_id for x in hit]} and {n} tokens"
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 20, 8) and s.hit_rate == pytest.approx(0.4), (
        f"stats (requests, queries, hits) = {(s.requests, s.queries, s.hits)}, expected (2, 20, 8): each lookup "
        "counts one request, its tokens as queries and the hit tokens")
    assert all(x.ref_cnt == 0 for x in hit), "get_computed_blocks must not take references"
    probe = m.get_computed_blocks(b, record_stats=False)
    assert probe == (hit, n) and (s.requests, s.queries, s.hits) == (2, 20, 8), (
        f"a probe (record_stats=False) changed the stats to {(s.requests, s.queries, s.hits)} or the answer: "
        "it must find the same hit and leave prefix_cache_stats alone")


def test_last_prompt_token_is_always_recomputed(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(10, 4)
    a = req(kv, "a", range(8))
    run(m, a)
    b = req(kv, "b", range(8))
    hit, n = m.get_computed_blocks(b)
    assert n == 4, "an 8-token prompt fully cached must still recompute its last token"


def test_matching_stops_at_first_miss(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(10, 2)
    a = req(kv, "a", [1, 2, 3, 4, 5, 6, 0])
    run(m, a)
    b = req(kv, "b", [1, 2, 9, 9, 5, 6, 0])  # block 2 has equal tokens but another parent
    hit, n = m.get_computed_blocks(b)
    assert n == 2, "a block after a miss must not match (its hash chains through the miss)"


def test_free_is_tail_first(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(6, 2)
    a = req(kv, "a", range(6))
    run(m, a)
    ids = m.get_block_ids("a")
    m.free(a)
    assert free_ids(m)[-3:] == ids[::-1], "the tail block must be queued (evicted) first"
    b = req(kv, "b", [99] * 7)  # needs 4 blocks: 3 never-used ones, then a's tail
    run(m, b)
    assert m.block_pool.get_cached_block(kv.hash_request_tokens(2, range(6))[0]) is not None, \
        "evicting one block must take a's tail, keeping its head cached"


def test_no_self_eviction_and_atomic_failure(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(4, 2)
    a = req(kv, "a", range(4))
    run(m, a)
    m.free(a)  # 4 free blocks, two of them cached (0..1, 2..3)
    order = free_ids(m)
    b = req(kv, "b", list(range(4)) + [7, 7, 7])  # hits 2 blocks, needs 2 more: 4 in total
    hit, n = m.get_computed_blocks(b)
    assert n == 4, "setup: b hits a's 2 cached blocks"
    # Counting the two hit blocks as free, 4 >= 2 would "fit"; it must not evict its own hits.
    assert m.allocate_slots(b, 3 + 4, n, hit) is None, \
        "b's hits sit in the free queue and were counted as free: b would evict its own hits"
    assert free_ids(m) == order and all(x.ref_cnt == 0 for x in hit), \
        "a refused allocation must leave ref counts and queue order untouched"
    assert m.get_block_ids("b") == [], "a refused allocation must give the request no blocks"
    assert m.allocate_slots(b, 3, n, hit) is not None, "2 hits + 2 new blocks fit a pool of 4"
    assert m.get_block_ids("b")[:2] == [x.block_id for x in hit], "the hit blocks must head the request's table"


def test_blocks_are_cached_as_they_fill_during_decode(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(8, 2)
    a = req(kv, "a", [1, 2, 3])
    run(m, a)
    a.append_output_token(4)
    assert m.allocate_slots(a, 1) == [], "the 4th token fits in a's second block: no new block"
    a.num_computed_tokens = 4
    blocks = m.block_pool.blocks
    assert blocks[m.get_block_ids("a")[1]].block_hash == kv.hash_request_tokens(2, [1, 2, 3, 4])[1], \
        "a block filled by a decode step must be cached under its chained hash"


def test_lookahead_slots_are_allocated_but_not_cached(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(8, 2)
    a = req(kv, "a", [1, 2, 3])
    got = m.allocate_slots(a, 3, num_lookahead_tokens=3)
    assert len(got) == 3 and len(m.get_block_ids("a")) == 3, "3 prompt + 3 lookahead tokens need 3 blocks of 2"
    assert [b.block_hash is not None for b in got] == [True, False, False], \
        "only the block full of prompt tokens may be hashed, never a lookahead (draft) slot"


def test_salt_isolation(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(10, 2)
    run(m, req(kv, "a", range(6), salt="tenant-a"))
    assert m.get_computed_blocks(req(kv, "b", range(6), salt="tenant-b"))[1] == 0, \
        "hash without salt: another tenant hit tenant-a's prefix"
    assert m.get_computed_blocks(req(kv, "c", range(6)))[1] == 0, "hash without salt: an unsalted request hit tenant-a's prefix"
    assert m.get_computed_blocks(req(kv, "d", range(6), salt="tenant-a"))[1] == 4, \
        "the same salt must hit its own cached prefix (4 tokens)"


def test_caching_disabled_is_a_plain_allocator(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(6, 2, enable_caching=False)
    a = req(kv, "a", range(4))
    run(m, a)
    m.free(a)
    assert m.get_computed_blocks(req(kv, "b", range(5))) == ([], 0), "with caching off a lookup must hit nothing"
    assert not m.block_pool.cached_block_hash_to_block, "with caching off no block may be hashed"


def test_fork_shares_blocks_and_copies_on_write(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(8, 4)
    p = req(kv, "p", range(6))
    run(m, p)
    p.append_output_token(10)
    c = req(kv, "c", list(p.all_token_ids[:-1]) + [20], computed=6)
    m.fork(p, c)
    assert m.get_block_ids("c") == m.get_block_ids("p") == [0, 1], "a fork must share the parent's blocks"
    assert [m.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2], \
        "a shared block must count both holders (fork takes a reference with touch)"
    assert m.num_free_blocks == 6, "a fork must not allocate"
    assert m.allocate_slots(c, 1) == [], "copy-on-write replaces a block; it appends none"
    assert m.get_block_ids("c") == [0, 2] and m.take_blocks_to_copy() == [(1, 2)], \
        "the first write into the shared partial block must copy it"
    assert m.take_blocks_to_copy() == [], "copies are handed out once"
    assert m.allocate_slots(p, 1) == [] and m.get_block_ids("p") == [0, 1], \
        "the parent, now the only holder of block 1, must keep it"
    assert m.take_blocks_to_copy() == [], "the last holder writes in place"
    m.free(p)
    m.free(c)
    assert m.num_free_blocks == 8, "after both requests free, every block must be free again (no leak)"


def test_reset_and_free_unknown(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(4, 2)
    a = req(kv, "a", range(4))
    run(m, a)
    assert m.reset_prefix_cache() is False, "a reset while blocks are in use must be refused"
    m.free(a)
    m.free(a)  # already freed: no-op
    m.free(req(kv, "ghost", [1]))
    assert m.num_free_blocks == 4 and m.usage == 0.0, \
        "freeing twice or freeing an unknown request must be a no-op, never a double free"
    assert m.reset_prefix_cache() is True, "a reset with every block free must succeed"
    assert m.get_computed_blocks(req(kv, "b", range(5)))[1] == 0, "a lookup after a reset must hit nothing"


def test_bad_arguments(chapter):
    kv = chapter("kvcache")
    m = kv.KVCacheManager(4, 2)
    r = req(kv, "a", range(4))
    for kw in ({"num_new_tokens": -1}, {"num_new_tokens": 1, "num_lookahead_tokens": -2},
               {"num_new_tokens": 1, "num_new_computed_tokens": -2}):
        with pytest.raises(ValueError, match=next(iter(k for k, v in kw.items() if v < 0))):
            m.allocate_slots(r, **kw)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        m.allocate_slots(r, 1, 2, [])
    with pytest.raises(ValueError, match="block_size"):
        kv.KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        kv.KVCacheManager(0, 2)
