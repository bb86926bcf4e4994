"""Cases and helpers shared by the kernel tests (Triton, numba CPU, the CPU layer ops):
scrambled block tables, NaN-filled paged caches built by plain indexing, the
bad-input table every paged-attention implementation must reject with the same
ValueError, and a thread-count context."""
import contextlib

import pytest
import torch

from strategies import BlockLayout


def scrambled_layout(seq_lens, block_size, seed, spare=3):
    """Non-contiguous block tables from a shuffled pool, rows padded with -1."""
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    rows, p = [], 0
    for n in needed:
        rows.append(tuple(ids[p:p + n]) + (-1,) * (max(needed) + 1 - n))
        p += n
    return BlockLayout(num_blocks, block_size, tuple(rows))


def build_cache(batch, layout, shape, dtype, seed, values=None):
    """NaN caches holding each sequence's K/V at its block-table slots; returns
    (key_cache, value_cache, tables, seq_lens, ks, vs, qs). `values(n, heads)`
    draws the entries of q and k (default: standard normal)."""
    g = torch.Generator().manual_seed(seed)
    draw = values or (lambda n, h: torch.randn(n, h, shape.head_dim, generator=g))
    cache_shape = (layout.num_blocks, layout.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    bs = layout.block_size
    ks, vs, qs = [], [], []
    for i, (s, q) in enumerate(zip(batch.seq_lens, batch.q_lens)):
        k = draw(s, shape.num_kv_heads).to(dtype)
        v = torch.randn(s, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
        for pos in range(s):
            key_cache[layout.block_tables[i][pos // bs], pos % bs] = k[pos]
            value_cache[layout.block_tables[i][pos // bs], pos % bs] = v[pos]
        ks.append(k)
        vs.append(v)
        qs.append(draw(q, shape.num_heads).to(dtype))
    tables = torch.tensor(layout.block_tables, dtype=torch.int32)
    return key_cache, value_cache, tables, torch.tensor(batch.seq_lens, dtype=torch.int32), ks, vs, qs


def good_args():
    key_cache = torch.zeros(4, 8, 2, 16)  # CPU: validation fails before any launch
    return dict(query=torch.zeros(2, 4, 16), key_cache=key_cache, value_cache=torch.zeros_like(key_cache),
                block_tables=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                seq_lens=torch.tensor([9, 3], dtype=torch.int32), scale=0.25)


BAD = [
    ("query", dict(query=torch.zeros(2, 4, 8)), "head_dim"),
    ("query", dict(query=torch.zeros(2, 3, 16)), "num_heads"),
    ("query", dict(query=torch.zeros(2, 4, 16, dtype=torch.float64)), "query"),
    ("value_cache", dict(value_cache=torch.zeros(4, 8, 2, 16, dtype=torch.float16)), "value_cache"),
    ("block_tables", dict(block_tables=torch.tensor([[0, 1], [2, -1]], dtype=torch.int64)), "block_tables"),
    ("block_tables", dict(block_tables=torch.tensor([[0, -1], [2, -1]], dtype=torch.int32)), "block_tables"),
    ("block_tables", dict(block_tables=torch.tensor([[0, 4], [2, -1]], dtype=torch.int32)), "block_tables"),
    ("seq_lens", dict(seq_lens=torch.tensor([17, 3], dtype=torch.int32)), "seq_lens"),
    ("seq_lens", dict(seq_lens=torch.tensor([0, 3], dtype=torch.int32)), "seq_lens"),
    ("scale", dict(scale=0.0), "scale"),
]
BAD_VARLEN = [
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)), "cu_seqlens_q"),
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 0, 2], dtype=torch.int32)), "cu_seqlens_q"),
    ("cu_seqlens_q", dict(query=torch.zeros(5, 4, 16), cu_seqlens_q=torch.tensor([0, 1, 5], dtype=torch.int32)),
     "cu_seqlens_q"),
]


def raised_message(fn, **kw):
    with pytest.raises(ValueError) as info:
        fn(**kw)
    return str(info.value)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch (and so the kernel) on n threads inside the block, then as before."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def native_builds() -> tuple:
    """The C++ kernel builds this CPU runs (cpu_native.ISAS order: "avx512", "avx2"), or
    (None,) where none does, so that a test parametrised over them still appears, skipped
    with the reason."""
    from mini_vllm.kernels import cpu_native
    return cpu_native.available_isas() or (None,)


@pytest.fixture(params=native_builds())
def native_isa(request):
    """Runs the test once per C++ build this CPU runs, that build forced
    (cpu_native.use_isa): on an AVX-512 machine both the AVX-512 and the AVX2 build, on an
    AVX2-only one the AVX2 build."""
    from mini_vllm.kernels import cpu_native
    if request.param is None:
        pytest.skip(f"the C++ kernels cannot run here: {cpu_native.unavailable_reason()}")
    with cpu_native.use_isa(request.param):
        yield request.param
