"""BlockPool behaviours documented by vLLM: eviction order, lazy removal, multimap, reset."""
import pytest


def free_ids(pool):
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_get_new_blocks_pops_head_and_evicts_in_queue_order(chapter):
    kv = chapter("kvcache")
    pool = kv.BlockPool(4)
    a = pool.get_new_blocks(4)
    hashes = [kv.hash_block_tokens(None, [i]) for i in range(4)]
    pool.cache_full_blocks(a, hashes, 0, 4)
    pool.free_blocks([a[2], a[0], a[3], a[1]])  # queue order is now 2, 0, 3, 1
    assert free_ids(pool) == [2, 0, 3, 1], f"free queue {free_ids(pool)}: free_blocks must append in the given order"
    for expect in [2, 0, 3, 1]:
        (b,) = pool.get_new_blocks(1)
        assert b.block_id == expect, "eviction must follow the free-queue order exactly"
        assert b.block_hash is None and pool.get_cached_block(hashes[expect]) is None, \
            "an evicted block must lose its hash and its hash-map entry"
        assert b.ref_cnt == 1, f"a newly allocated block has ref_cnt {b.ref_cnt}, expected 1"


def test_touch_removes_free_block_lazily_and_keeps_hash(chapter):
    kv = chapter("kvcache")
    pool = kv.BlockPool(3)
    blocks = pool.get_new_blocks(3)
    h = kv.hash_block_tokens(None, [7])
    pool.cache_full_blocks(blocks, [h], 0, 1)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [0, 1, 2], f"free queue {free_ids(pool)}: freed blocks must join the tail in order"
    hit = pool.get_cached_block(h)
    assert hit is blocks[0] and hit.ref_cnt == 0, "a freed block stays cached until evicted"
    pool.touch([hit])
    assert free_ids(pool) == [1, 2] and hit.ref_cnt == 1 and hit.block_hash == h, \
        "touch on a free cached block must unlink it, take one reference and keep its hash"
    assert pool.get_num_free_blocks() == 2 and pool.get_usage() == pytest.approx(1 / 3), \
        "a touched block no longer counts as free"
    pool.touch([hit])
    assert hit.ref_cnt == 2, "touching a block in use only raises ref_cnt"
    pool.free_blocks([hit])
    assert free_ids(pool) == [1, 2], "a block with holders left must not be queued"
    pool.free_blocks([hit])
    assert free_ids(pool) == [1, 2, 0], "a block reaching ref_cnt 0 goes to the tail"
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([hit])


def test_hash_map_is_a_multimap(chapter):
    kv = chapter("kvcache")
    pool = kv.BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = kv.hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert set(pool.cached_block_hash_to_block[h]) == {a.block_id, b.block_id}, \
        "two blocks cached under one hash must both be in the multimap"
    pool.free_blocks([a, b])
    (x,) = pool.get_new_blocks(1)  # evicts a only
    assert x is a and pool.get_cached_block(h) is b, "evicting one copy must keep the other"
    assert pool.cached_block_hash_to_block[h] == {b.block_id: b}, \
        "evicting one copy must remove only that block's entry under the hash"
    (y,) = pool.get_new_blocks(1)
    assert y is b and h not in pool.cached_block_hash_to_block and len(pool.cached_block_hash_to_block) == 0, \
        "evicting the last copy must leave no entry for its hash"


def test_reset_prefix_cache_refused_while_in_use(chapter):
    kv = chapter("kvcache")
    pool = kv.BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = kv.hash_block_tokens(None, [3])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False, "a reset while block b is in use must be refused"
    assert pool.get_cached_block(h) is a, "a refused reset must change nothing"
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True, "a reset with every block free must succeed"
    assert pool.get_cached_block(h) is None and a.block_hash is None, \
        "a reset must empty the hash map and clear every block's hash"


def test_caching_disabled_and_bad_sizes(chapter):
    kv = chapter("kvcache")
    pool = kv.BlockPool(2, enable_caching=False)
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [kv.hash_block_tokens(None, [1])], 0, 1)
    assert a[0].block_hash is None and not pool.cached_block_hash_to_block, \
        "with caching off, cache_full_blocks must hash nothing"
    with pytest.raises(ValueError, match="cannot get"):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="num_blocks"):
        kv.BlockPool(0)
