"""Chapter 5 attention backends vs Chapter 1's reference (the oracle).

The oracle is `reshape_and_cache` + `paged_attention_varlen` from
`mini_vllm.paged_attention`, a per-sequence loop that Chapter 1's tests check
against dense attention. The caches start NaN-filled except for the positions
that earlier steps would have written, so a backend that reads an unused slot,
a -1 table entry or a position past seq_len returns NaN and fails.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from mini_vllm.attention.backends import BACKEND_NAMES, default_backend, get_attn_backend
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.paged_attention import paged_attention_varlen, reshape_and_cache
from strategies import block_layouts, gqa_shapes, ragged_batches

HEAD_DIMS = (16, 32)


def make_case(seq_lens, q_lens, tables, num_blocks, block_size, heads, kv_heads, head_dim,
              dtype=torch.float32, seed=0):
    """NaN caches holding each sequence's first seq_len - q_len positions, this
    step's q/k/v, and the metadata. Returns (q, k, v, key_cache, value_cache, md)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc, vc = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    slots = []
    for s, q, row in zip(seq_lens, q_lens, tables):
        for p in range(s):
            b, o = row[p // block_size], p % block_size
            if p < s - q:  # written by an earlier step
                kc[b, o] = torch.randn(kv_heads, head_dim, generator=g).to(dtype)
                vc[b, o] = torch.randn(kv_heads, head_dim, generator=g).to(dtype)
            else:
                slots.append(b * block_size + o)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype)
    width = max(len(r) for r in tables)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([list(r) + [-1] * (width - len(r)) for r in tables], dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens))
    return q, k, v, kc, vc, md


def oracle(q, k, v, kc, vc, md, scale):
    kc, vc = kc.clone(), vc.clone()
    reshape_and_cache(k, v, kc, vc, md.slot_mapping)
    out = paged_attention_varlen(q, kc, vc, md.block_tables, md.cu_seqlens_q, md.seq_lens, scale)
    return out, kc, vc


def check_against_oracle(backend_name, case, atol, rtol, what):
    q, k, v, kc, vc, md = case
    scale = q.shape[-1] ** -0.5
    ref, ref_kc, ref_vc = oracle(q, k, v, kc, vc, md, scale)
    out = get_attn_backend(backend_name).forward(q, k, v, kc, vc, md, scale)
    assert out.shape == q.shape and out.dtype == q.dtype, f"{backend_name}: output must be [T, H, D] in query dtype"
    assert torch.equal(kc.isnan(), ref_kc.isnan()) and torch.equal(kc.nan_to_num(), ref_kc.nan_to_num()) \
        and torch.equal(vc.nan_to_num(), ref_vc.nan_to_num()), \
        f"{backend_name}: the cache after forward differs from reshape_and_cache at slot_mapping ({what})"
    assert not out.isnan().any(), f"{backend_name}: NaN output: a padded, unused or future slot was read ({what})"
    err = (out.float() - ref.float()).abs().max().item()
    assert torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol), \
        f"{backend_name}: differs from Chapter 1's reference by {err:.2e} ({what}): wrong mask, GQA map or row order"


@given(batch=ragged_batches(max_seqs=5, max_seq_len=48), shape=gqa_shapes(head_dims=HEAD_DIMS, ratios=(1, 2, 4)),
       block_size=st.sampled_from((8, 16)), data=st.data())
def test_torch_backend_matches_reference_on_ragged_batches(batch, shape, block_size, data):
    layout = data.draw(block_layouts(batch.seq_lens, block_size))
    case = make_case(batch.seq_lens, batch.q_lens, layout.block_tables, layout.num_blocks, block_size,
                     shape.num_heads, shape.num_kv_heads, shape.head_dim, seed=data.draw(st.integers(0, 2**16)))
    check_against_oracle("torch", case, 1e-5, 1e-5, f"{batch}, {shape}, block_size {block_size}")


@given(batch=ragged_batches(max_seqs=16, max_seq_len=40, decode_only=True),
       shape=gqa_shapes(head_dims=HEAD_DIMS, ratios=(1, 2, 4)), data=st.data())
def test_torch_backend_matches_reference_on_decode_batches(batch, shape, data):
    layout = data.draw(block_layouts(batch.seq_lens, 8))
    case = make_case(batch.seq_lens, batch.q_lens, layout.block_tables, layout.num_blocks, 8,
                     shape.num_heads, shape.num_kv_heads, shape.head_dim)
    check_against_oracle("torch", case, 1e-5, 1e-5, f"decode {batch}, {shape}")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backends_half_precision(backend, dtype):
    # A whole prefill, a chunk after a prefix and a decode; 16-bit outputs
    # round to ~3 significant digits, so the bound is a few output ulps. On a
    # CPU "triton" runs in the interpreter, where the kernel loads 16-bit
    # values, computes in fp32 and rounds once on the store.
    case = make_case([21, 30, 9], [21, 6, 1], [[4, 0, 7], [2, 5, 1, 3], [6, 8]], 9, 8, 4, 2, 32, dtype=dtype)
    check_against_oracle(backend, case, 2e-2, 2e-2, f"{dtype}")


# The Triton interpreter is slow: tiny shapes only.
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("seq_lens,q_lens,tables,num_blocks,gqa", [
    ([5, 12, 3], [5, 4, 1], [[2], [0, 3], [1]], 5, (4, 2)),
    ([17, 1], [1, 1], [[4, 1, 3], [0]], 5, (4, 1)),
])
def test_backends_match_reference_small(backend, seq_lens, q_lens, tables, num_blocks, gqa):
    case = make_case(seq_lens, q_lens, tables, num_blocks, 8, gqa[0], gqa[1], 16)
    check_against_oracle(backend, case, 1e-5, 1e-5, f"seq_lens {seq_lens}, q_lens {q_lens}")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_reads_blocks_another_sequence_writes_in_the_same_call(backend):
    """Sequence 0 (first in the batch) shares block 3 with sequence 1 and
    queries only its last 2 positions; block 3 is written by sequence 1 in the
    same call. Right only if the whole batch is cached before attention."""
    q, k, v, kc, vc, md = make_case([10, 8], [2, 8], [[3, 0], [3]], 4, 8, 2, 2, 16)
    kc[3], vc[3] = float("nan"), float("nan")  # only sequence 1's write in this call fills block 3
    check_against_oracle(backend, (q, k, v, kc, vc, md), 1e-5, 1e-5, "same-call shared block")


def test_backend_names_and_default():
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('torch', 'triton', 'cpu'\)"):
        get_attn_backend("flash_attn")
    with pytest.raises(ValueError, match="attention_backend"):
        get_attn_backend(None)
    assert default_backend("cpu") == "cpu", "CPU must default to the compiled kernel, not torch or the Triton interpreter"
    assert default_backend(torch.device("cuda", 0)) == "triton", "CUDA must default to the compiled kernels"


def test_cpu_backends_cache_write_equals_reshape_and_cache():
    """The cpu backend writes K/V with one index_copy_ per cache on the flat slot
    view; it must store exactly what Chapter 1's reshape_and_cache stores, -1
    slots (tokens whose K/V is not kept) included, and touch nothing else."""
    from mini_vllm.attention.backends import write_kv_in_place

    g = torch.Generator().manual_seed(0)
    kc, vc = torch.full((6, 8, 2, 16), float("nan")), torch.full((6, 8, 2, 16), float("nan"))
    key, value = torch.randn(10, 2, 16, generator=g), torch.randn(10, 2, 16, generator=g)
    slots = torch.randperm(48, generator=g)[:10]
    slots[[2, 7]] = -1
    want_k, want_v = kc.clone(), vc.clone()
    reshape_and_cache(key, value, want_k, want_v, slots)
    real = slots >= 0
    write_kv_in_place(key, value, kc, vc, slots[real].long(), real)
    assert torch.equal(kc.nan_to_num(7.0), want_k.nan_to_num(7.0)), "key cache differs from reshape_and_cache's"
    assert torch.equal(vc.nan_to_num(7.0), want_v.nan_to_num(7.0)), "value cache differs from reshape_and_cache's"


@pytest.mark.parametrize("parallelism,split", [(1, False), (132, True)])
def test_triton_decode_step_splits_keys_when_the_batch_cannot_fill_the_device(monkeypatch, parallelism, split):
    """A pure-decode step of 2 sequences x 1 KV head is 2 programs: on a device of
    132 SMs the backend must take the split-KV kernel (FlashDecoding), on one of
    a single core the plain decode kernel; both give the reference's result."""
    from mini_vllm.attention import backends
    from mini_vllm.kernels import paged_attention_split

    launches = []
    real = paged_attention_split.split_kv_launch
    monkeypatch.setattr(paged_attention_split, "split_kv_launch",
                        lambda *a, **kw: launches.append(a[-1]) or real(*a, **kw))
    monkeypatch.setattr(backends, "_parallelism", lambda device: parallelism)
    case = make_case([40, 9], [1, 1], [[4, 0, 7, 5, 2], [6, 8]], 9, 8, 4, 1, 16)
    check_against_oracle("triton", case, 1e-5, 1e-5, f"decode step, parallelism {parallelism}")
    assert bool(launches) == split, (f"parallelism {parallelism}: split-KV launches {launches}; a small decode batch "
                                     "must split its keys only when its programs cannot fill the device")
    if split:
        assert launches == [paged_attention_split.num_segments_for(2, 1, parallelism)], launches
