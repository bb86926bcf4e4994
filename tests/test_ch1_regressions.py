"""Chapter 1 / kernels: regression tests for bugs found by acceptance testing.

Oracle: the PyTorch reference (`mini_vllm.paged_attention`), which indexes
with torch and so honours any stride; it is itself checked against dense
attention in test_ch1_attention.py. The strided index tensors are built so
that the entries a stride-ignoring kernel would read instead are still valid
(in range), so the old bug shows as a wrong result rather than a crash.
"""
import pytest
import torch

from mini_vllm.kernels import paged_attention as kpa
from mini_vllm.kernels.reshape_and_cache import reshape_and_cache as k_reshape_and_cache

ref = pytest.importorskip("mini_vllm.paged_attention")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 8, 4, 1, 2, 16
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731


def random_cache(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return (torch.randn(shape, generator=g).to(dtype).to(DEVICE),
            torch.randn(shape, generator=g).to(dtype).to(DEVICE))


def every_other(values, filler):
    """A stride-2 view whose entries are `values`; the gaps hold `filler`."""
    base = torch.empty(2 * len(values), dtype=torch.int32, device=DEVICE)
    base[0::2], base[1::2] = i32(values), i32(filler)
    return base[0::2]


def strided_table(rows, filler_block):
    """A [num_seqs, n] view with column stride 2; the gaps hold another valid block."""
    base = torch.full((len(rows), 2 * len(rows[0])), filler_block, dtype=torch.int32, device=DEVICE)
    base[:, 0::2] = i32(rows)
    return base[:, 0::2]


def test_strided_block_tables_decode_and_varlen():
    kc, vc = random_cache()
    rows = [[0, 1, 2], [3, 4, 5]]
    table = strided_table(rows, filler_block=7)
    assert table.stride(1) == 2, "setup: the block table must be a non-contiguous view (column stride 2)"
    seq_lens = i32([11, 9])
    q = torch.randn(2, HEADS, HEAD_DIM, device=DEVICE)
    out = kpa.paged_attention_decode(q, kc, vc, table, seq_lens, 0.25)
    expected = ref.paged_attention_decode(q, kc, vc, i32(rows), seq_lens, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5,
                               msg="strided block_tables bug: decode kernel read the table as contiguous")
    qv, cu = torch.randn(5, HEADS, HEAD_DIM, device=DEVICE), i32([0, 2, 5])
    out = kpa.paged_attention_varlen(qv, kc, vc, table, cu, seq_lens, 0.25)
    expected = ref.paged_attention_varlen(qv, kc, vc, i32(rows), cu, seq_lens, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5,
                               msg="strided block_tables bug: varlen kernel read the table as contiguous")


def test_strided_seq_lens_and_cu_seqlens_q():
    kc, vc = random_cache(seed=1)
    table = i32([[0, 1, 2], [3, 4, 5]])
    seq_lens = every_other([11, 9], filler=[5, 5])  # the gap would be read as seq_lens[1]
    q = torch.randn(2, HEADS, HEAD_DIM, device=DEVICE)
    out = kpa.paged_attention_decode(q, kc, vc, table, seq_lens, 0.25)
    expected = ref.paged_attention_decode(q, kc, vc, table, seq_lens.contiguous(), 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5,
                               msg="strided seq_lens bug: decode kernel read seq_lens as contiguous")
    qv = torch.randn(5, HEADS, HEAD_DIM, device=DEVICE)
    cu = every_other([0, 2, 5], filler=[1, 2, 3])  # read as [0, 1, 2]: wrong sequence boundaries
    out = kpa.paged_attention_varlen(qv, kc, vc, table, cu, seq_lens, 0.25)
    expected = ref.paged_attention_varlen(qv, kc, vc, table, cu.contiguous(), seq_lens.contiguous(), 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5,
                               msg="strided cu_seqlens_q/seq_lens bug: varlen kernel read them as contiguous")


def test_strided_slot_mapping_reshape_and_cache():
    slots = every_other([0, 5, -1, 13], filler=[30, 21, 17, 9])  # gaps are valid, distinct slots
    k = torch.randn(4, KV_HEADS, HEAD_DIM, device=DEVICE)
    v = torch.randn(4, KV_HEADS, HEAD_DIM, device=DEVICE)
    got_k, got_v = (torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), float("nan"), device=DEVICE)
                    for _ in range(2))
    want_k, want_v = got_k.clone(), got_v.clone()
    k_reshape_and_cache(k, v, got_k, got_v, slots)
    ref.reshape_and_cache(k, v, want_k, want_v, slots.contiguous())
    for got, want in ((got_k, want_k), (got_v, want_v)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0,
                                   msg="strided slot_mapping bug: kernel wrote to the gaps' slots")


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_query_dtype_must_match_cache(impl):
    """A float32 query on a float16 cache used to pass the checks; the GPU fast
    path then fed mixed dtypes to tl.dot and failed while the reference answered."""
    pa = ref if impl == "reference" else kpa
    kc, vc = random_cache(dtype=torch.float16)
    table, seq_lens = i32([[0, 1, 2], [3, 4, 5]]), i32([11, 9])
    q = torch.randn(2, HEADS, HEAD_DIM, device=DEVICE)  # float32
    with pytest.raises(ValueError, match="query dtype float32 must equal the cache's dtype float16"):
        pa.paged_attention_decode(q, kc, vc, table, seq_lens, 0.25)
    with pytest.raises(ValueError, match="query dtype"):
        pa.paged_attention_varlen(q, kc, vc, table, i32([0, 1, 2]), seq_lens, 0.25)
