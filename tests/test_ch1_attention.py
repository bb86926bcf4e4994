"""Chapter 1: paged attention (decode and varlen) against the dense oracle.

K/V are placed into the paged cache by the test itself (not by the code under
test), every other slot is NaN, so reading any slot past seq_len, any unused
block or any -1 table entry turns the output into NaN.
"""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from oracles import dense_causal_attention
from strategies import BlockLayout, GQAShape, RaggedBatch, block_layouts, block_sizes, gqa_shapes, ragged_batches

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def make_case(batch, layout, shape, dtype, seed=0):
    """Random contiguous K/V/Q per sequence, copied into a NaN-filled paged cache."""
    g = torch.Generator().manual_seed(seed)
    cache_shape = (layout.num_blocks, layout.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    ks, vs, qs = [], [], []
    bs = layout.block_size
    for i, (s, q) in enumerate(zip(batch.seq_lens, batch.q_lens)):
        k = torch.randn(s, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
        v = torch.randn(s, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
        for j in range(-(-s // bs)):
            n = min(bs, s - j * bs)
            key_cache[layout.block_tables[i][j], :n] = k[j * bs:j * bs + n]
            value_cache[layout.block_tables[i][j], :n] = v[j * bs:j * bs + n]
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(q, shape.num_heads, shape.head_dim, generator=g).to(dtype))
    tables = torch.tensor(layout.block_tables, dtype=torch.int32)
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
    return key_cache, value_cache, tables, seq_lens, ks, vs, qs


def assert_close(out, expected, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in output -> a slot past seq_len, an unused block or a -1 entry was read"
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= TOL[dtype], f"{what}: max abs error {err:.3g} > {TOL[dtype]} in {dtype} (wrong block, mask or GQA head mapping?)"


@st.composite
def cases(draw, decode_only=False):
    batch = draw(ragged_batches(max_seqs=4, max_seq_len=64, decode_only=decode_only))
    bs = draw(block_sizes())
    layout = draw(block_layouts(batch.seq_lens, bs))
    shape = draw(gqa_shapes())
    dtype = draw(st.sampled_from(DTYPES))
    return batch, layout, shape, dtype


def _check_varlen(pa, batch, layout, shape, dtype):
    key_cache, value_cache, tables, seq_lens, ks, vs, qs = make_case(batch, layout, shape, dtype)
    scale = 1.0 / math.sqrt(shape.head_dim)
    cu = torch.tensor(batch.cu_seqlens_q, dtype=torch.int32)
    out = pa.paged_attention_varlen(torch.cat(qs), key_cache, value_cache, tables, cu, seq_lens, scale)
    assert out.shape == torch.cat(qs).shape and out.dtype == dtype, "output must have query's shape and dtype"
    for i in range(batch.num_seqs):
        expected = dense_causal_attention(qs[i], ks[i], vs[i], scale)
        assert_close(out[cu[i]:cu[i + 1]], expected, dtype,
                     f"seq {i} (seq_len {batch.seq_lens[i]}, q_len {batch.q_lens[i]}, block {layout.block_size}, "
                     f"heads {shape.num_heads}/{shape.num_kv_heads})")


def test_varlen_matches_dense_oracle(chapter):
    pa = chapter("paged_attention")

    @given(cases())
    def run(case):
        _check_varlen(pa, *case)

    run()


def test_decode_matches_dense_oracle(chapter):
    pa = chapter("paged_attention")

    @given(cases(decode_only=True))
    def run(case):
        batch, layout, shape, dtype = case
        key_cache, value_cache, tables, seq_lens, ks, vs, qs = make_case(batch, layout, shape, dtype)
        scale = 1.0 / math.sqrt(shape.head_dim)
        query = torch.cat(qs)  # one row per sequence
        out = pa.paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, scale)
        assert out.shape == query.shape and out.dtype == dtype, "output must have query's shape and dtype"
        for i in range(batch.num_seqs):
            expected = dense_causal_attention(qs[i], ks[i], vs[i], scale)
            assert_close(out[i:i + 1], expected, dtype, f"decode seq {i} (seq_len {batch.seq_lens[i]})")

    run()


@pytest.mark.parametrize("ratio", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_every_gqa_ratio_and_block_size_with_partial_last_block(chapter, ratio, block_size):
    """Explicit grid, so no GQA ratio or block size depends on hypothesis luck.
    seq_len 37 is not a multiple of any block size; q_lens cover 1, a chunk and the whole prompt."""
    pa = chapter("paged_attention")
    batch = RaggedBatch(seq_lens=(37, 37, 37, 5), q_lens=(1, 12, 37, 5))
    needed = [-(-s // block_size) for s in batch.seq_lens]
    ids = torch.randperm(sum(needed) + 3, generator=torch.Generator().manual_seed(block_size + ratio)).tolist()
    tables, pos = [], 0
    for n in needed:
        tables.append(tuple(ids[pos:pos + n] + [-1] * (max(needed) + 1 - n)))
        pos += n
    layout = BlockLayout(len(ids), block_size, tuple(tables))
    _check_varlen(pa, batch, layout, GQAShape(2 * ratio, 2, 16), torch.float32)


def test_minus_one_padding_never_wraps_to_last_block(chapter):
    """Rows padded with -1; the last physical block (where -1 would wrap) is all NaN
    and belongs to nobody, so using a -1 entry as an index would show as NaN."""
    pa = chapter("paged_attention")
    batch = RaggedBatch(seq_lens=(9, 3), q_lens=(1, 1))
    layout = BlockLayout(num_blocks=5, block_size=8, block_tables=((2, 0, -1, -1), (1, -1, -1, -1)))
    _check_varlen(pa, batch, layout, GQAShape(4, 2, 16), torch.float32)


def test_decode_equals_varlen_with_q_len_one(chapter):
    """The two entry points must agree on decode batches (the engine may call either)."""
    pa = chapter("paged_attention")
    batch = RaggedBatch(seq_lens=(17, 1, 32), q_lens=(1, 1, 1))
    layout = BlockLayout(8, 16, ((5, 2), (0, -1), (7, 3)))
    key_cache, value_cache, tables, seq_lens, _, _, qs = make_case(batch, layout, GQAShape(4, 1, 32), torch.float32)
    q = torch.cat(qs)
    cu = torch.arange(4, dtype=torch.int32)
    a = pa.paged_attention_decode(q, key_cache, value_cache, tables, seq_lens, 0.2)
    b = pa.paged_attention_varlen(q, key_cache, value_cache, tables, cu, seq_lens, 0.2)
    assert torch.allclose(a, b, atol=1e-6), "decode and varlen(q_len=1) disagree"
