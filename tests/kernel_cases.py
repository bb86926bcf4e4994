"""Cases and helpers shared by the kernel tests (Triton, numba CPU, the CPU layer ops):
scrambled block tables, the bad-input table every paged-attention implementation
must reject with the same ValueError, and a thread-count context."""
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
