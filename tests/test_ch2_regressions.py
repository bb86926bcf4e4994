"""Chapter 2: regression tests for bugs found by acceptance testing.

Oracle: the tokens themselves. A prefix hit is only valid if the hit blocks
were filled with exactly the request's leading tokens, which the test knows
because it chose them.
"""
import pytest

from mini_vllm.kvcache import BlockPool, KVCacheManager, SimpleRequest

BS = 4


def test_reused_request_id_does_not_hit_stale_hashes():
    """A request looked up and dropped without free() left its hashes under its
    id; a new request reusing the id then hit blocks holding the old tokens."""
    m = KVCacheManager(num_blocks=8, block_size=BS)
    old_tokens, new_tokens = list(range(1, 10)), list(range(100, 109))
    writer = SimpleRequest("writer", old_tokens)
    assert m.allocate_slots(writer, len(old_tokens)) is not None, "setup: the writer fits"  # caches 2 full blocks

    dropped = SimpleRequest("r", old_tokens)
    blocks, n = m.get_computed_blocks(dropped)
    assert n == 2 * BS, "setup: a genuine hit on the writer's 2 blocks"  # then dropped, never freed

    reused = SimpleRequest("r", new_tokens)  # same id, other tokens
    blocks, n = m.get_computed_blocks(reused)
    assert (blocks, n) == ([], 0), (
        "stale-hash bug: a new request reusing an id hit blocks holding another request's tokens")
    # The reused id then runs normally and caches its own tokens.
    assert m.allocate_slots(reused, len(new_tokens)) is not None, "setup: the reused id fits"
    again = SimpleRequest("again", new_tokens)
    assert m.get_computed_blocks(again)[1] == 2 * BS, "the reused id's own blocks must be cached under its tokens"


def test_reused_id_with_scheduler_request():
    """The same bug with Chapter 3's Request, the object the scheduler passes."""
    sched_req = pytest.importorskip("mini_vllm.scheduler").Request
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate_slots(SimpleRequest("w", list(range(9))), 9)
    m.get_computed_blocks(sched_req("r", list(range(9))))
    _, n = m.get_computed_blocks(sched_req("r", list(range(50, 59))))
    assert n == 0, "stale-hash bug: Chapter 3's Request under a reused id hit another prompt's blocks"


def test_fork_child_keeps_parent_hashes():
    """fork copies the parent's hashes to the child, so the child's later
    full blocks chain from the right parent hash."""
    m = KVCacheManager(num_blocks=8, block_size=BS)
    parent = SimpleRequest("p", list(range(6)))
    m.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = SimpleRequest("c", list(range(6)), num_computed_tokens=6)
    m.fork(parent, child)
    child.all_token_ids += [6, 7, 8]
    assert m.allocate_slots(child, 3) is not None, "setup: the child's 3 new tokens fit"
    probe = SimpleRequest("probe", list(range(9)))
    assert m.get_computed_blocks(probe)[1] == 2 * BS, "a forked child's second block must chain from the parent's first"


def test_free_blocks_is_all_or_nothing():
    """free_blocks decremented earlier blocks before raising on a later double free."""
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    for bad in ([a, b, b], [a, pool.blocks[3]]):  # b freed twice; block 3 is already free
        with pytest.raises(ValueError, match="double free"):
            pool.free_blocks(bad)
        assert (a.ref_cnt, b.ref_cnt) == (1, 1), "non-atomic free_blocks bug: counts changed before the error"
        assert pool.get_num_free_blocks() == 2, "non-atomic free_blocks bug: a block joined the free queue"
    pool.touch([b])  # ref_cnt 2: listing it twice is a legal release of both references
    pool.free_blocks([a, b, b])
    assert pool.get_num_free_blocks() == 4, \
        "a block listed twice with 2 references is a legal release of both: every block must end free"
