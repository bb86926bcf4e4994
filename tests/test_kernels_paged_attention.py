"""Chapter 1 Triton kernels against the dense oracle and the PyTorch reference.

The tests build the paged cache themselves (never with the code under test)
and fill every other slot with NaN, so a kernel that reads a slot past
seq_len, an unused block or a -1 table entry returns NaN. The oracle is
`dense_causal_attention` on contiguous K/V in float64; the reference
(`mini_vllm.paged_attention`) must agree too, since a learner swaps one for
the other. These are kernel tests: they do not use the --impl switch.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mini_vllm.kernels import paged_attention as kpa
from mini_vllm.kernels.paged_attention import paged_attention_decode, paged_attention_varlen
from mini_vllm.kernels.reshape_and_cache import reshape_and_cache
from kernel_cases import BAD, BAD_VARLEN, build_cache as build_cache_cpu, good_args, raised_message, scrambled_layout
from oracles import dense_causal_attention
from strategies import GQAShape, RaggedBatch, block_layouts, block_sizes, gqa_shapes, ragged_batches

ref = pytest.importorskip("mini_vllm.paged_attention")

# CPU under the Triton interpreter here; the real GPU path on a CUDA machine.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def build_cache(batch, layout, shape, dtype, seed):
    """kernel_cases.build_cache's caches, tables and lengths on DEVICE."""
    key_cache, value_cache, tables, seq_lens, ks, vs, qs = build_cache_cpu(batch, layout, shape, dtype, seed)
    return key_cache.to(DEVICE), value_cache.to(DEVICE), tables.to(DEVICE), seq_lens.to(DEVICE), ks, vs, qs


def max_err(out, expected):
    return (out.float().cpu() - expected.float().cpu()).abs().max().item()


def assert_close(out, expected, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in output -> a slot past seq_len, an unused block or a -1 entry was read"
    err = max_err(out, expected)
    assert err <= TOL[dtype], (f"{what}: max abs error {err:.3g} > {TOL[dtype]} in {dtype} "
                               "(wrong block lookup, causal mask, GQA head mapping or softmax rescale?)")


def check_varlen(batch, layout, shape, dtype, seed=0):
    key_cache, value_cache, tables, seq_lens, ks, vs, qs = build_cache(batch, layout, shape, dtype, seed)
    scale = 1.0 / math.sqrt(shape.head_dim)
    cu = torch.tensor(batch.cu_seqlens_q, dtype=torch.int32, device=DEVICE)
    query = torch.cat(qs).to(DEVICE)
    out = paged_attention_varlen(query, key_cache, value_cache, tables, cu, seq_lens, scale)
    assert out.shape == query.shape and out.dtype == dtype, "output must have query's shape and dtype"
    for i in range(batch.num_seqs):
        what = (f"varlen seq {i} (seq_len {batch.seq_lens[i]}, q_len {batch.q_lens[i]}, block {layout.block_size}, "
                f"heads {shape.num_heads}/{shape.num_kv_heads})")
        assert_close(out[cu[i]:cu[i + 1]], dense_causal_attention(qs[i], ks[i], vs[i], scale), dtype, what)
    expected = ref.paged_attention_varlen(query, key_cache, value_cache, tables, cu, seq_lens, scale)
    assert_close(out, expected, dtype, "varlen kernel vs PyTorch reference")
    return out


def check_decode(batch, layout, shape, dtype, seed=0):
    key_cache, value_cache, tables, seq_lens, ks, vs, qs = build_cache(batch, layout, shape, dtype, seed)
    scale = 1.0 / math.sqrt(shape.head_dim)
    query = torch.cat(qs).to(DEVICE)
    out = paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, scale)
    assert out.shape == query.shape and out.dtype == dtype, "output must have query's shape and dtype"
    for i in range(batch.num_seqs):
        what = f"decode seq {i} (seq_len {batch.seq_lens[i]}, block {layout.block_size}, heads {shape.num_heads}/{shape.num_kv_heads})"
        assert_close(out[i:i + 1], dense_causal_attention(qs[i], ks[i], vs[i], scale), dtype, what)
    expected = ref.paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, scale)
    assert_close(out, expected, dtype, "decode kernel vs PyTorch reference")
    return out


@st.composite
def cases(draw, decode_only=False):
    batch = draw(ragged_batches(max_seqs=3, max_seq_len=48, decode_only=decode_only))
    bs = draw(block_sizes())
    layout = draw(block_layouts(batch.seq_lens, bs))
    return batch, layout, draw(gqa_shapes()), draw(st.sampled_from(DTYPES))


@settings(max_examples=30)
@given(cases())
def test_varlen_kernel_matches_oracle_and_reference(case):
    check_varlen(*case)


@settings(max_examples=20)
@given(cases(decode_only=True))
def test_decode_kernel_matches_oracle_and_reference(case):
    check_decode(*case)


# Every GQA ratio x block size once, on one batch mixing a decode, a whole
# prefill (not a multiple of the block size) and a chunk after earlier tokens.
MIXED = RaggedBatch(seq_lens=(13, 21, 40), q_lens=(1, 21, 11))


@pytest.mark.parametrize("ratio", (1, 2, 4, 8))
@pytest.mark.parametrize("block_size", (8, 16, 32))
def test_varlen_every_gqa_ratio_and_block_size(ratio, block_size):
    dtype = DTYPES[(ratio + block_size // 8) % 3]  # spreads the three dtypes over the grid
    check_varlen(MIXED, scrambled_layout(MIXED.seq_lens, block_size, seed=ratio * block_size),
                 GQAShape(2 * ratio, 2, 16), dtype, seed=ratio)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_many_query_tiles(monkeypatch, dtype):
    """16-row query tiles with MHA: a 40-token prefill spans 3 tiles, so the
    per-tile sequence lookup and the per-tile causal bound are exercised."""
    monkeypatch.setattr(kpa, "VARLEN_BLOCK_M", 16)
    batch = RaggedBatch(seq_lens=(3, 40, 33, 17), q_lens=(3, 40, 18, 1))
    check_varlen(batch, scrambled_layout(batch.seq_lens, 8, seed=7), GQAShape(2, 2, 32), dtype)


@settings(max_examples=20)
@given(st.data())
def test_reshape_and_cache_scatters_and_skips_padding(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    index_dtype = data.draw(st.sampled_from((torch.int32, torch.int64)))
    bs = data.draw(block_sizes())
    num_blocks = data.draw(st.integers(1, 4))
    shape = data.draw(gqa_shapes(max_kv_heads=3))
    slots = data.draw(st.lists(st.one_of(st.just(-1), st.integers(0, num_blocks * bs - 1)),
                               min_size=1, max_size=20, unique_by=lambda s: s if s >= 0 else object()))
    n = len(slots)
    g = torch.Generator().manual_seed(n)
    key = torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
    value = torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    slot_mapping = torch.tensor(slots, dtype=index_dtype, device=DEVICE)
    reshape_and_cache(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slot_mapping)
    key_cache, value_cache = key_cache.cpu(), value_cache.cpu()
    # Oracle: a Python loop over tokens.
    exp_k = torch.full(cache_shape, float("nan"), dtype=dtype)
    exp_v = torch.full(cache_shape, float("nan"), dtype=dtype)
    for t, s in enumerate(slots):
        if s >= 0:
            exp_k[s // bs, s % bs] = key[t]
            exp_v[s // bs, s % bs] = value[t]
    assert torch.equal(key_cache.isnan(), exp_k.isnan()), "a padding slot (-1) was written or a real slot was missed"
    assert torch.equal(key_cache.nan_to_num(0.0), exp_k.nan_to_num(0.0)), "keys landed in the wrong slot or were altered"
    assert torch.equal(value_cache.nan_to_num(0.0), exp_v.nan_to_num(0.0)) and torch.equal(
        value_cache.isnan(), exp_v.isnan()), "values landed in the wrong slot or were altered"
    ref_k, ref_v = torch.full(cache_shape, 0.5, dtype=dtype), torch.full(cache_shape, 0.5, dtype=dtype)
    ref.reshape_and_cache(key, value, ref_k, ref_v, torch.tensor(slots, dtype=index_dtype))
    assert torch.equal(key_cache.nan_to_num(0.5), ref_k), "kernel and PyTorch reference wrote different caches"
    assert torch.equal(value_cache.nan_to_num(0.5), ref_v), "kernel and PyTorch reference wrote different caches"


# --- bad input: same ValueError (type and message) as the reference ----------

@pytest.mark.parametrize("field,change,word", BAD + BAD_VARLEN)
def test_varlen_bad_input_matches_reference(field, change, word):
    args = {**good_args(), **change}
    msg = raised_message(paged_attention_varlen, **args)
    assert word in msg, f"error for bad {field} must name it: {msg!r}"
    assert msg == raised_message(ref.paged_attention_varlen, **args), "kernel and reference must reject alike"


@pytest.mark.parametrize("field,change,word", BAD)
def test_decode_bad_input_matches_reference(field, change, word):
    args = {**good_args(), **change}
    del args["cu_seqlens_q"]
    msg = raised_message(paged_attention_decode, **args)
    assert word in msg, f"error for bad {field} must name it: {msg!r}"
    assert msg == raised_message(ref.paged_attention_decode, **args), "kernel and reference must reject alike"


@pytest.mark.parametrize("change,word", [
    (dict(slot_mapping=torch.tensor([0, 32])), "slot_mapping"),
    (dict(slot_mapping=torch.tensor([0, -2])), "slot_mapping"),
    (dict(slot_mapping=torch.tensor([0.0, 1.0])), "slot_mapping"),
    (dict(slot_mapping=torch.tensor([0])), "slot_mapping"),
    (dict(key=torch.zeros(2, 3, 16)), "key"),
    (dict(value=torch.zeros(2, 2, 16, dtype=torch.float16)), "value"),
])
def test_reshape_and_cache_bad_input_matches_reference(change, word):
    key_cache = torch.zeros(4, 8, 2, 16)
    args = dict(key=torch.zeros(2, 2, 16), value=torch.zeros(2, 2, 16), key_cache=key_cache,
                value_cache=torch.zeros_like(key_cache), slot_mapping=torch.tensor([0, 1]))
    args.update(change)
    msg = raised_message(reshape_and_cache, **args)
    assert word in msg, f"error must name {word}: {msg!r}"
    assert msg == raised_message(ref.reshape_and_cache, **args), "kernel and reference must reject alike"
