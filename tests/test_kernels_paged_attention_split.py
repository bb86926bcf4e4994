"""The split-KV decode kernel (FlashDecoding) against the dense oracle and the reference.

As in test_kernels_paged_attention.py the caches are built by plain indexing
and every unused slot holds NaN, so reading past seq_len shows up as NaN.
What is new here is the split: 1 to many segments per (sequence, KV head),
segments that fall past a short sequence's end (empty), partial last blocks,
and a workspace reused across calls as a replayed CUDA graph reuses its
buffers: its stale or NaN entries must never reach the output.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mini_vllm.kernels import paged_attention_split as split
from mini_vllm.kernels.paged_attention_split import (SplitKVWorkspace, num_segments_for,
                                                     paged_attention_decode_split)
from kernel_cases import BAD, build_cache as build_cache_cpu, good_args, raised_message, scrambled_layout
from oracles import dense_causal_attention
from strategies import GQAShape, RaggedBatch, block_layouts, block_sizes, gqa_shapes, ragged_batches
# The paged kernel's tests build caches on the same device, with the same dtypes and tolerances.
from test_kernels_paged_attention import DTYPES, TOL, build_cache as build

ref = pytest.importorskip("mini_vllm.paged_attention")

# CPU under the Triton interpreter here; the real GPU path on a CUDA machine.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def assert_matches_oracle(out, ks, vs, qs, scale, dtype, what):
    assert not torch.isnan(out).any(), (f"{what}: NaN in the output -> a slot past seq_len was read, or an empty "
                                        "segment's (never written) workspace entry reached the reduce")
    for i in range(len(qs)):
        expected = dense_causal_attention(qs[i], ks[i], vs[i], scale)
        err = (out[i:i + 1].float().cpu() - expected.float()).abs().max().item()
        assert err <= TOL[dtype], (
            f"{what}, seq {i} (seq_len {ks[i].shape[0]}): max abs error {err:.3g} > {TOL[dtype]} in {dtype} "
            "(segments not rescaled to the global max in the reduce, a segment's keys read twice or skipped, "
            "or an empty segment counted?)")


def check(batch, layout, shape, dtype, num_segments, seed=0, workspace=None):
    kc, vc, tables, seq_lens, ks, vs, qs = build(batch, layout, shape, dtype, seed)
    scale = 1.0 / math.sqrt(shape.head_dim)
    query = torch.cat(qs).to(DEVICE)
    out = paged_attention_decode_split(query, kc, vc, tables, seq_lens, scale, num_segments=num_segments,
                                       workspace=workspace)
    assert out.shape == query.shape and out.dtype == dtype, "output must have query's shape and dtype"
    what = f"{num_segments} segments, block {layout.block_size}, heads {shape.num_heads}/{shape.num_kv_heads}"
    assert_matches_oracle(out, ks, vs, qs, scale, dtype, what)
    expected = ref.paged_attention_decode(query, kc, vc, tables, seq_lens, scale)
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= TOL[dtype], f"{what}: split kernel and PyTorch reference differ by {err:.3g}"
    return out


# A long sequence (many key tiles) beside short ones: with 4+ segments the short
# ones use fewer segments than the launch has (empty segments); none is a whole
# number of blocks (partial last blocks).
MIXED = RaggedBatch(seq_lens=(150, 5, 37), q_lens=(1, 1, 1))


@pytest.mark.parametrize("num_segments", (1, 2, 4, 8))
@pytest.mark.parametrize("ratio", (1, 4, 8))
def test_every_segment_count_and_gqa_ratio(num_segments, ratio):
    dtype = DTYPES[(num_segments + ratio) % 3]  # spreads the dtypes over the grid
    layout = scrambled_layout(MIXED.seq_lens, 16, seed=num_segments * ratio)
    check(MIXED, layout, GQAShape(2 * ratio, 2, 32), dtype, num_segments, seed=ratio)


@pytest.mark.parametrize("dtype", DTYPES)
def test_segments_with_different_maxima(dtype):
    """One key far larger than the rest in the last segment only: the segments'
    maxima differ by ~40 in log2 units, so a reduce that adds the partial sums
    without rescaling each to the global maximum is off by orders of magnitude.
    130 keys in 32-key tiles are 5 tiles: segments of 2 tiles, 3 of the 4 used."""
    batch = RaggedBatch(seq_lens=(130,), q_lens=(1,))
    shape = GQAShape(4, 2, 32)
    layout = scrambled_layout(batch.seq_lens, 8, seed=3)
    g = torch.Generator().manual_seed(5)

    def values(n, heads):
        x = torch.randn(n, heads, shape.head_dim, generator=g) * 0.1
        if n == batch.seq_lens[0]:  # the keys: a spike at position 120 (the second segment)
            x[120] = 2.0
        else:  # the query: aligned with the spike
            x[:] = 2.0
        return x

    kc, vc, tables, seq_lens, ks, vs, qs = build_cache_cpu(batch, layout, shape, dtype, 0, values=values)
    scale = 1.0 / math.sqrt(shape.head_dim)
    out = paged_attention_decode_split(torch.cat(qs).to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables.to(DEVICE),
                                       seq_lens.to(DEVICE), scale, num_segments=4)
    assert_matches_oracle(out, ks, vs, qs, scale, dtype, "a spike in one segment")


@settings(max_examples=12, deadline=None)
@given(batch=ragged_batches(max_seqs=3, max_seq_len=100, decode_only=True), bs=block_sizes(), shape=gqa_shapes(),
       dtype=st.sampled_from(DTYPES), num_segments=st.sampled_from((1, 2, 4, 8, 16)), data=st.data())
def test_random_decode_batches(batch, bs, shape, dtype, num_segments, data):
    layout = data.draw(block_layouts(batch.seq_lens, bs))
    check(batch, layout, shape, dtype, num_segments)


def test_workspace_reused_across_calls_like_a_graph_replay():
    """One workspace, poisoned with NaN, serves a step of long sequences and then
    a step of short ones (as a replayed graph's buffers do): segments that the
    second step leaves empty still hold the first step's partials, which must
    not leak into its output."""
    shape, dtype, segments = GQAShape(4, 2, 32), torch.float32, 8
    ws = SplitKVWorkspace.allocate(2, shape.num_heads, shape.head_dim, segments, DEVICE)
    for t in (ws.out, ws.max, ws.sum):
        t.fill_(float("nan"))
    for step, lens in enumerate(((200, 170), (40, 9), (200, 3))):
        batch = RaggedBatch(seq_lens=lens, q_lens=(1, 1))
        check(batch, scrambled_layout(lens, 16, seed=step), shape, dtype, segments, seed=step, workspace=ws)


def test_one_segment_equals_the_plain_decode_kernel():
    from mini_vllm.kernels.paged_attention import paged_attention_decode

    shape = GQAShape(8, 2, 32)
    kc, vc, tables, seq_lens, ks, vs, qs = build(MIXED, scrambled_layout(MIXED.seq_lens, 16, seed=1), shape,
                                                 torch.float32, 0)
    q = torch.cat(qs).to(DEVICE)
    a = paged_attention_decode_split(q, kc, vc, tables, seq_lens, 0.25, num_segments=1)
    b = paged_attention_decode(q, kc, vc, tables, seq_lens, 0.25)
    assert (a - b).abs().max().item() <= 1e-6, "one segment must be the plain decode kernel's arithmetic"


@pytest.mark.parametrize("seqs,kv_heads,sms,expected", [
    (1, 8, 132, 32),    # batch 1 on an H100: 8 programs -> cut each into the cap of 32
    (4, 8, 132, 16),    # 32 programs x 16 >= 264
    (16, 8, 132, 4),    # 128 x 4 = 512 >= 264 (x 2 would be 256 < 264)
    (64, 8, 132, 1),    # 512 programs already fill 132 SMs twice: no split
    (1, 2, 2, 2),       # a 2-core CPU: 2 programs -> 2 segments
    (2, 2, 2, 1),
])
def test_segment_count_from_shapes(seqs, kv_heads, sms, expected):
    got = num_segments_for(seqs, kv_heads, sms)
    assert got == expected, f"num_segments_for({seqs}, {kv_heads}, {sms}) = {got}, want {expected}"
    assert got & (got - 1) == 0 and 1 <= got <= split.MAX_SEGMENTS, "segments must be a power of two within the cap"


@pytest.mark.parametrize("field,change,word", BAD)
def test_bad_input_matches_the_decode_reference(field, change, word):
    args = {**good_args(), **change}
    del args["cu_seqlens_q"]
    msg = raised_message(paged_attention_decode_split, **args)
    assert word in msg, f"error for bad {field} must name it: {msg!r}"
    assert msg == raised_message(ref.paged_attention_decode, **args), "split kernel and reference must reject alike"


@pytest.mark.parametrize("bad", (0, 3, 2048, 2.0, True))
def test_bad_segment_count_is_named(bad):
    args = {**good_args()}
    del args["cu_seqlens_q"]
    msg = raised_message(paged_attention_decode_split, **args, num_segments=bad)
    assert "num_segments" in msg and "power of two" in msg, msg


def test_workspace_of_the_wrong_shape_is_refused():
    args = {**good_args()}
    del args["cu_seqlens_q"]
    ws = SplitKVWorkspace.allocate(2, 4, 16, 2, "cpu")
    msg = raised_message(paged_attention_decode_split, **args, num_segments=4, workspace=ws)
    assert "workspace" in msg, msg
