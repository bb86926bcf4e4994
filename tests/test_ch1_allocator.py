"""Chapter 1: allocate_kv_cache and the reference-counting BlockAllocator."""
import pytest
import torch
from hypothesis import given, strategies as st


def test_allocate_kv_cache_shape_dtype(chapter):
    pa = chapter("paged_attention")
    k, v = pa.allocate_kv_cache(5, 16, 2, 32, dtype=torch.bfloat16)
    assert k.shape == v.shape == (5, 16, 2, 32), "cache layout must be [num_blocks, block_size, num_kv_heads, head_dim]"
    assert k.dtype == v.dtype == torch.bfloat16, f"caches allocated as {k.dtype} / {v.dtype}: the dtype argument was ignored"
    assert k.data_ptr() != v.data_ptr(), "key and value caches must be separate tensors"


def test_allocator_refcounts_and_reuse(chapter):
    pa = chapter("paged_attention")
    a = pa.BlockAllocator(3)
    x, y, z = a.allocate_n(3)
    assert sorted([x, y, z]) == [0, 1, 2] and a.num_free_blocks == 0, \
        f"allocate_n(3) on a 3-block pool gave {[x, y, z]} with {a.num_free_blocks} free: a block handed out twice or not counted"
    a.incref(y)  # y shared by two sequences
    assert a.ref_cnt(y) == 2, f"incref on a held block left ref_cnt {a.ref_cnt(y)}, expected 2: a second holder not counted"
    a.free(y)
    assert a.num_free_blocks == 0 and a.ref_cnt(y) == 1, "a shared block must stay allocated until its last user frees it"
    a.free(y)
    assert a.num_free_blocks == 1 and a.ref_cnt(y) == 0, "the last holder's free must return the block to the free list"
    assert a.allocate() == y, "the only free block must be handed out again"


def test_allocator_errors(chapter):
    pa = chapter("paged_attention")
    a = pa.BlockAllocator(2)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    with pytest.raises(ValueError, match="block_id"):
        a.free(7)
    with pytest.raises(ValueError, match="block_id"):
        a.ref_cnt(-1)
    with pytest.raises(ValueError, match="free"):
        a.incref(b)
    a.allocate_n(2)
    with pytest.raises(pa.NoFreeBlocksError):
        a.allocate()
    with pytest.raises(ValueError, match="num_blocks"):
        pa.BlockAllocator(0)


def test_allocate_n_is_all_or_nothing(chapter):
    pa = chapter("paged_attention")
    a = pa.BlockAllocator(4)
    a.allocate()
    with pytest.raises(pa.NoFreeBlocksError):
        a.allocate_n(4)
    assert a.num_free_blocks == 3, "a failed allocate_n must not leak blocks"


def test_allocator_random_ops_keep_invariants(chapter):
    """Against a tiny model: each id is either free (count 0) or held (count >= 1)."""
    pa = chapter("paged_attention")

    @given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "free"]), st.integers(0, 5)), max_size=60))
    def run(ops):
        a = pa.BlockAllocator(6)
        model = [0] * 6
        for op, i in ops:
            if op == "alloc":
                if model.count(0) == 0:
                    with pytest.raises(pa.NoFreeBlocksError):
                        a.allocate()
                    continue
                b = a.allocate()
                assert model[b] == 0, f"allocate returned block {b} that is still in use"
                model[b] = 1
            elif op == "incref" and model[i] > 0:
                a.incref(i)
                model[i] += 1
            elif op == "free" and model[i] > 0:
                a.free(i)
                model[i] -= 1
            assert [a.ref_cnt(b) for b in range(6)] == model, \
                f"after {op} {i}: ref counts {[a.ref_cnt(b) for b in range(6)]}, expected {model}"
            assert a.num_free_blocks == model.count(0), \
                f"after {op} {i}: num_free_blocks {a.num_free_blocks} but {model.count(0)} blocks have no holder"

    run()
