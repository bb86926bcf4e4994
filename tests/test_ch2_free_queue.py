"""The LRU free queue against a plain Python list as the oracle."""
import pytest
from hypothesis import given
from hypothesis import strategies as st


def ids(q):
    return [b.block_id for b in q.get_all_free_blocks()]


def test_initial_order_and_popleft(chapter):
    kv = chapter("kvcache")
    blocks = [kv.KVCacheBlock(i) for i in range(4)]
    q = kv.FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 4 and ids(q) == [0, 1, 2, 3], \
        f"a new queue holds {ids(q)} ({q.num_free_blocks} counted): it must keep the given blocks in order"
    assert q.popleft() is blocks[0], "popleft must return the head (least recently freed)"
    assert q.popleft_n(2) == blocks[1:3], "popleft_n must return the next n blocks from the head, in queue order"
    assert ids(q) == [3] and q.num_free_blocks == 1, \
        f"after popping 3 of 4 blocks the queue holds {ids(q)} ({q.num_free_blocks} counted), expected [3]"


def test_pop_empty_raises_clear_error(chapter):
    kv = chapter("kvcache")
    q = kv.FreeKVCacheBlockQueue([])
    with pytest.raises(ValueError, match="free"):
        q.popleft()
    q.append(kv.KVCacheBlock(0))
    with pytest.raises(ValueError, match="free"):
        q.popleft_n(2)
    assert q.num_free_blocks == 1, "a refused popleft_n must not pop anything"


def test_remove_middle_and_append_tail(chapter):
    kv = chapter("kvcache")
    blocks = [kv.KVCacheBlock(i) for i in range(5)]
    q = kv.FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4], f"removing block 2 from the middle left {ids(q)}: the neighbours must be relinked"
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None, \
        "a removed block must have its links cleared"
    q.append(blocks[2])
    assert ids(q) == [0, 1, 3, 4, 2], "append must put the block at the tail (evicted last)"
    with pytest.raises(ValueError):
        q.append(blocks[2])  # already queued: appending again would corrupt the list
    q.remove(blocks[0])
    with pytest.raises(ValueError):
        q.remove(blocks[0])


@given(ops=st.lists(st.tuples(st.sampled_from(["pop", "remove", "append"]), st.integers(0, 7)),
                    max_size=60))
def test_queue_matches_list_model(chapter, ops):
    kv = chapter("kvcache")
    blocks = [kv.KVCacheBlock(i) for i in range(8)]
    q = kv.FreeKVCacheBlockQueue(blocks)
    model = list(range(8))
    for op, i in ops:
        if op == "pop":
            if model:
                want = model.pop(0)
                assert q.popleft().block_id == want, f"popleft must return the head, block {want}"
            else:
                with pytest.raises(ValueError):
                    q.popleft()
        elif op == "remove" and i in model:
            q.remove(blocks[i])
            model.remove(i)
        elif op == "append" and i not in model:
            q.append(blocks[i])
            model.append(i)
        assert ids(q) == model and q.num_free_blocks == len(model), \
            f"after {op} {i}: queue {ids(q)} ({q.num_free_blocks} counted), expected {model}"
        # Walking backwards from the tail sentinel must give the reverse order.
        back, node = [], q._tail.prev_free_block
        while node is not q._head:
            back.append(node.block_id)
            node = node.prev_free_block
        assert back == model[::-1], "prev links disagree with next links"
